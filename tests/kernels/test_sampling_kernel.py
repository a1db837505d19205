"""The fused Gumbel-max sampler (kernel/sampling.py) with skipped rows: a CUDA graph's sampling
passes the rows its step samples again (`Engine.forward`'s resample), giving 0 there and
the same ids elsewhere. On CUDA at Qwen3's vocabulary, otherwise under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DEVICE = torch.device("cuda" if CUDA else "cpu")
SHAPES = [(5, 151936), (256, 151936)] if CUDA else [(5, 3000), (3, 20000)]


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@on_device
@pytest.mark.parametrize("shape", SHAPES)
def test_skipped_rows_are_left_out(shape):
    ops = kernel_module("sampling")
    batch, vocab = shape
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)
    temperature = torch.tensor([0.0, 0.7, 1.3] * batch)[:batch].to(DEVICE)
    seed = torch.arange(batch, device=DEVICE) * 7 + 1
    step = torch.arange(batch, device=DEVICE) + 100
    skip = (torch.arange(batch, device=DEVICE) % 2).long()
    full = ops.gumbel_argmax(logits, temperature, seed, step)
    part = ops.gumbel_argmax(logits, temperature, seed, step, skip)
    kept = skip == 0
    assert torch.equal(part[kept], full[kept])
    assert not bool(part[~kept].any())
    assert torch.equal(full[0], logits[0].argmax())  # row 0 is greedy
    # temperatures read at their stride, as a step's block carries them (no copy first)
    strided = torch.zeros(batch, 2, device=DEVICE)
    strided[:, 0] = temperature
    assert torch.equal(ops.gumbel_argmax(logits, strided[:, 0], seed, step), full)


@on_device
@pytest.mark.parametrize("shape", [(1, SHAPES[-1][1]), *SHAPES])
def test_ids_written_into_the_table_where_they_are_picked(shape):
    """`into`: the pick kernel also writes each row's id to table[rows, step] (the token table),
    skipped rows' 0 included; nothing else in the table changes, and the ids are those of the
    call without it. Batch 1 spreads the vocabulary over the most chunks."""
    ops = kernel_module("sampling")
    batch, vocab = shape
    gen = torch.Generator().manual_seed(vocab + batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)
    temperature = torch.tensor([0.6, 0.0, 1.1] * batch)[:batch].to(DEVICE)
    seed = torch.arange(batch, device=DEVICE) + 11
    step = torch.arange(batch, device=DEVICE) * 3 + 2
    skip = (torch.arange(batch, device=DEVICE) % 3 == 2).long()
    table = torch.full((batch + 3, 3 * batch + 3), -7, dtype=torch.int32, device=DEVICE)
    rows = torch.arange(batch, device=DEVICE).flip(0) + 2
    want = ops.gumbel_argmax(logits, temperature, seed, step, skip)
    got = ops.gumbel_argmax(logits, temperature, seed, step, skip, into=(table, rows))
    assert torch.equal(got, want)
    expected = torch.full_like(table, -7)
    expected[rows, step] = want.to(torch.int32)
    assert torch.equal(table, expected)


def test_sample_into_writes_the_table_on_the_torch_path():
    from minisgl.engine.sample import sample

    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 300, generator=gen) * 2
    temperature, seed = torch.tensor([0.0, 0.5, 1.0, 2.0]), torch.arange(4) + 1
    step, rows = torch.tensor([3, 4, 5, 6]), torch.tensor([1, 0, 3, 2])
    table = torch.zeros(4, 8, dtype=torch.int32)
    got = sample(logits, temperature, seed, step, into=(table, rows))
    assert torch.equal(got, sample(logits, temperature, seed, step))
    assert torch.equal(table[rows, step], got.to(torch.int32))
    assert int((table != 0).sum()) <= 4


def test_step_inputs_round_trip():
    """StepInputs.pack / unpack: every row as packed, kv_lens = cached + extend, temperatures
    exact float32 views of the int64 block (greedy 0), no copies on unpack."""
    from minisgl.core import Req, SamplingParams
    from minisgl.engine.step import StepInputs

    reqs = [
        Req([1, 2, 3], 7, SamplingParams(temperature=0.7, seed=2**40 + 5), 8, table_idx=3),
        Req([4], 2, SamplingParams(temperature=0.0), 3, table_idx=5),
    ]
    reqs[0].cached_len, reqs[0].extend_len = 10, 1
    reqs[1].cached_len, reqs[1].extend_len = 0, 4
    block = StepInputs.pack(reqs, [True, False], dummy_row=9, device=torch.device("cpu"))
    inputs = StepInputs.unpack(block, 2)
    assert inputs.rows.tolist() == [3, 5] and inputs.write_rows.tolist() == [3, 9]
    assert inputs.kv_lens.tolist() == [11, 4] and inputs.skips.tolist() == [0, 1]
    assert inputs.temperatures.dtype == torch.float32
    assert inputs.temperatures.tolist() == [torch.tensor(0.7).item(), 0.0]
    assert inputs.seeds.tolist() == [5, reqs[1].seed & 0xFFFFFFFF]
    assert inputs.temperatures.data_ptr() == block[-1].data_ptr()  # a view, not a copy
    # an odd batch: the block is padded to an even width, so every row starts 16-byte aligned
    # (Triton compiles a variant per pointer alignment: an odd batch met mid-run would stall)
    odd = StepInputs.pack(reqs + reqs[:1], [True] * 3, dummy_row=9, device=torch.device("cpu"))
    inputs = StepInputs.unpack(odd, 3)
    assert odd.shape == (8, 4) and inputs.rows.tolist() == [3, 5, 3]
    assert inputs.temperatures.tolist() == [torch.tensor(0.7).item(), 0.0, torch.tensor(0.7).item()]
    assert all(getattr(inputs, f).data_ptr() % 16 == 0 for f in ("kv_lens", "seeds", "skips"))
    assert inputs.temperatures.data_ptr() % 16 == 0


@on_device
def test_kernel_draws_the_torch_paths_ids(monkeypatch):
    """The kernel's noise is the torch path's counter hash bit for bit (on uint32 there: seeds
    and steps whose products overflow 32 bits check its unsigned shifts), so both draw the same
    ids; greedy rows and a row of tied logits keep the first id."""
    from minisgl.engine.sample import sample

    ops = kernel_module("sampling")
    vocab = SHAPES[-1][1]
    gen = torch.Generator().manual_seed(9)
    logits = (torch.randn(7, vocab, generator=gen) * 3).to(DEVICE)
    logits[6] = 1.0  # greedy over a tie: id 0
    temperature = torch.tensor([0.0, 0.5, 1.0, 1.7, 0.9, 1.0, 0.0], device=DEVICE)
    seed = torch.tensor([2**40 + 3, 2**31 + 7, 5, 2**32 - 1, 123456789, 0, 1], device=DEVICE)
    step = torch.tensor([0, 1, 2**31, 77, 3_000_000_000, 12, 5], device=DEVICE)
    got = ops.gumbel_argmax(logits, temperature, seed, step)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    want = sample(logits, temperature, seed, step)
    assert torch.equal(got, want), (got, want)
    assert got[6].item() == 0


@on_device
def test_kernel_noise_is_the_gumbel_noise_to_float_rounding():
    """The kernel's noise comes from approximate base-2 logs (lg2.approx on a GPU, whose absolute
    error near 1 is why -log2(u) has a series there): within 2e-6 of -ln(-ln(u)), about half a
    float32 ulp of a score near 16, for every uniform the hash gives (on CUDA all 2**23;
    interpreted: those nearest 1, around the series' switch at 15/16, and a spread)."""
    ops = kernel_module("sampling")
    m = torch.arange(2**23)
    if not CUDA:
        switch = 15 * 2**19
        m = torch.cat([m[-2048:], m[switch - 1024 : switch + 1024], m[:: 2**12]])
    u = (m.double() + 0.5) * 2.0**-23
    got = ops.gumbel_noise(u.float().to(DEVICE)).double().cpu()
    err = (got - -torch.log(-torch.log(u))).abs()
    assert err.max().item() < 2e-6, (err.max().item(), u[err.argmax()].item())


@pytest.mark.skipif(CUDA, reason="the smoke run is the CPU one")
def test_benchmark_smoke():
    """benchmark/kernels/sampling_bench.py --smoke runs interpreted and matches the torch path."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cmd = [sys.executable, os.path.join(root, "benchmark", "kernels", "sampling_bench.py")]
    env_vars = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    proc = subprocess.run(
        cmd + ["--smoke"], capture_output=True, text=True, timeout=120, env=env_vars
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("torch path's: 100%") == 2, proc.stdout
