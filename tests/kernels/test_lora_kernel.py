"""The LoRA kernel (ext/lora/kernel.py) against its torch reference (`layers.lora_reference`):
on CUDA at Qwen3-8B's projection shapes in bf16 and float32, otherwise on small shapes under
the Triton interpreter (TRITON_INTERPRET=1). Tokens mix slot 0 (no adapter) with every
adapter, in runs (prefill segments) and interleaved (decode rows); merged projections of
three (qkv) and two (gate_up) parts and single ones; ranks below the padded r_max."""

from __future__ import annotations

import pytest
import torch

from minisgl.ext.lora.layers import lora_reference
from minisgl.ext.lora.weights import ProjectionLora
from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DEVICE = torch.device("cuda" if CUDA else "cpu")
# (parts' output rows, input features): Qwen3-8B's qkv, gate_up and down at TP 1 on CUDA
SHAPES = (
    [([4096, 1024, 1024], 4096), ([12288, 12288], 4096), ([4096], 12288)]
    if CUDA
    else [([48, 16, 16], 40), ([24, 24], 32), ([20], 600)]  # 600: the shrink splits K
)
TOKENS = [1, 7, 33, 300] if CUDA else [1, 5, 37]
DTYPES = [torch.bfloat16, torch.float32] if CUDA else [torch.float32]


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@pytest.fixture(scope="module")
def ops():
    return kernel_module("minisgl.ext.lora.kernel")


def _projection(sizes: list[int], fan_in: int, slots: int, rank: int, dtype, gen):
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    a = torch.randn(slots + 1, len(sizes) * rank, fan_in, generator=gen) / fan_in**0.5
    b = torch.randn(slots + 1, bounds[-1], rank, generator=gen) / rank**0.5
    a[0], b[0] = 0, 0
    a[2].view(len(sizes), rank, fan_in)[:, rank // 2 :] = 0  # slot 2: half the rank, padded
    b[2, :, rank // 2 :] = 0
    offsets = torch.tensor(bounds, dtype=torch.int32)
    return ProjectionLora(
        None,  # type: ignore[arg-type]  (the kernel needs no layer)
        tuple(str(i) for i in range(len(sizes))),
        rank,
        a.to(DEVICE, dtype),
        b.to(DEVICE, dtype),
        bounds,
        offsets.to(DEVICE),
    )


def _slots(tokens: int, slots: int, interleaved: bool, gen) -> torch.Tensor:
    if interleaved:  # decode rows: any slot in any row
        return torch.randint(0, slots + 1, (tokens,), generator=gen, dtype=torch.int32)
    runs = torch.randint(0, slots + 1, (max(1, tokens // 9) + 1,), generator=gen)
    return runs.repeat_interleave(9)[:tokens].to(torch.int32)  # prefill: runs of one slot


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("interleaved", [False, True])
def test_kernel_matches_reference(ops, dtype, shape, tokens, interleaved):
    gen = torch.Generator().manual_seed(tokens + len(shape[0]))
    sizes, fan_in = shape
    proj = _projection(sizes, fan_in, 3, 16, dtype, gen)
    x = torch.randn(tokens, fan_in, generator=gen).to(DEVICE, dtype)
    y = torch.randn(tokens, proj.bounds[-1], generator=gen).to(DEVICE, dtype)
    slots = _slots(tokens, 3, interleaved, gen)
    slots[tokens // 2] = 1  # some row has an adapter
    slots = slots.to(DEVICE)
    expected = lora_reference(y, x, slots, proj)
    out = ops.lora_add(y.clone(), x, slots, proj.a, proj.b, proj.offsets, proj.bounds)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(out, expected, **tol)
    base = slots == 0  # rows without an adapter are untouched, bit for bit
    assert torch.equal(out[base], y[base])
    assert not torch.allclose(out[~base], y[~base], atol=1e-3)


@on_device
def test_kernel_without_adapter_rows_changes_nothing(ops):
    gen = torch.Generator().manual_seed(0)
    proj = _projection(*SHAPES[0], 2, 16, DTYPES[-1], gen)
    x = torch.randn(5, SHAPES[0][1], generator=gen).to(DEVICE, DTYPES[-1])
    y = torch.randn(5, proj.bounds[-1], generator=gen).to(DEVICE, DTYPES[-1])
    slots = torch.zeros(5, dtype=torch.int32, device=DEVICE)
    out = ops.lora_add(y.clone(), x, slots, proj.a, proj.b, proj.offsets, proj.bounds)
    assert torch.equal(out, y)


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,silu", [(SHAPES[0], False), (SHAPES[1], True), (SHAPES[2], False)])
@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_joint_expand_matches_reference(ops, dtype, shape, silu, tokens):
    """A decode step's one launch after the GEMV over [A of every slot; W]: base + each
    token's delta (gate_up: then SiLU(gate) * up), against the reference on base = x W^T."""
    from minisgl.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(tokens + 10 * len(shape[0]))
    sizes, fan_in = shape
    proj = _projection(sizes, fan_in, 3, 16, dtype, gen)
    weight = (torch.randn(proj.bounds[-1], fan_in, generator=gen) / fan_in**0.5).to(DEVICE, dtype)
    x = torch.randn(tokens, fan_in, generator=gen).to(DEVICE, dtype)
    joint = torch.cat([proj.a.flatten(0, 1), weight])
    out = (x.float() @ joint.float().T).to(dtype)  # what the GEMV writes
    slots = (torch.arange(tokens, dtype=torch.int32) + 1) % 4  # every adapter, then slot 0
    slots = slots.to(DEVICE)
    lead = joint.shape[0] - weight.shape[0]
    expected = lora_reference(out[:, lead:], x, slots, proj)
    y = ops.lora_expand_joint(out, slots, proj.b, proj.offsets, proj.bounds, silu)
    if silu:
        expected = silu_and_mul(expected)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(y, expected, **tol)
    if not silu:  # rows without an adapter are the GEMV's, bit for bit
        assert torch.equal(y[slots == 0], out[slots == 0, lead:])
    plain = silu_and_mul(out[:, lead:]) if silu else out[:, lead:]
    assert not torch.allclose(y[slots != 0], plain[slots != 0], atol=1e-3)  # the deltas count


@pytest.mark.gpu
def test_kernel_replays_in_a_cuda_graph_with_new_slots(ops):
    """The slot indices are a graph input: a captured launch computes the slots written into
    the same tensor before each replay."""
    gen = torch.Generator().manual_seed(1)
    sizes, fan_in = SHAPES[0]
    proj = _projection(sizes, fan_in, 3, 16, torch.bfloat16, gen)
    x = torch.randn(64, fan_in, generator=gen).to(DEVICE, torch.bfloat16)
    y0 = torch.randn(64, proj.bounds[-1], generator=gen).to(DEVICE, torch.bfloat16)
    slots = torch.zeros(64, dtype=torch.int32, device=DEVICE)
    y = y0.clone()
    ops.lora_add(y, x, slots, proj.a, proj.b, proj.offsets, proj.bounds)  # compile first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ops.lora_add(y, x, slots, proj.a, proj.b, proj.offsets, proj.bounds)
    for interleaved in (False, True):
        slots.copy_(_slots(64, 3, interleaved, gen).to(DEVICE))
        y.copy_(y0)
        graph.replay()
        expected = lora_reference(y0, x, slots, proj)
        torch.testing.assert_close(out, expected, atol=3e-2, rtol=2e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU one")
def test_benchmark_smoke() -> None:
    """benchmark/kernels/lora_bench.py --smoke checks the default tiles and a swept one
    against the torch reference, interpreted."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "benchmark", "kernels", "lora_bench.py"), "--smoke"]
    cmd += ["--tokens", "3", "--shapes", "o", "--rank", "4", "--slots", "2", "--max-split", "0,4"]
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count(": checked") == 2 and "WRONG" not in proc.stdout, proc.stdout
