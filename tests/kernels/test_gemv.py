"""The small-batch GEMV (kernel/gemv.py) against F.linear: on CPU tiny shapes under the Triton
interpreter (TRITON_INTERPRET=1), on CUDA the Qwen3-0.6B shapes, every benchmark candidate
config, and a tiny model's greedy tokens with the GEMV on and off (CUDA graphs on). The
dispatch rule (`kernel.gemv_eligible`) and the layers' wiring run on CPU too."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl import kernel
from minisgl.kernel import flags
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import ReplicatedLinear, RowParallelLinear
from minisgl.models.llama import MLP

CUDA = torch.cuda.is_available()
# the flag must be set before anything imports triton (see tests/test_kernels.py)
INTERPRETABLE = not CUDA and (
    "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
)
if INTERPRETABLE:
    os.environ["TRITON_INTERPRET"] = "1"
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# the kernel rounds once from float32; the reference is the float32 product rounded once, so
# they differ by the summation order plus one rounding (the interpreter truncates to bf16)
TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}


@pytest.fixture(scope="module")
def gemv():
    pytest.importorskip("triton")
    if not CUDA and not INTERPRETABLE:
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    from minisgl.kernel import gemv

    return gemv


def problem(m: int, n: int, k: int, dtype: torch.dtype, seed: int, bias: bool = False):
    """x [m, k], weight [n, k] scaled so outputs are O(1), bias [n] or None."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) / k**0.5
    b = torch.randn(n, generator=gen) if bias else None
    to = lambda t: None if t is None else t.to(DEVICE, dtype)  # noqa: E731
    return to(x), to(w), to(b)


def reference(x, w, b, silu: bool = False) -> torch.Tensor:
    """F.linear in float64 (no tf32 whatever the global flags say), rounded once; SiLU-and-mul
    as the unfused path has it: on the rounded gate_up, in the dtype."""
    y = F.linear(x.double(), w.double(), None if b is None else b.double()).to(x.dtype)
    return silu_and_mul_torch(y) if silu else y


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    if out.numel() == 0:
        return
    tol = TOL[out.dtype]
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max error {err:.3g} > {tol} x scale {scale:.3g}"


# interpreter configs: the heuristic (None), a 2-way split of K with a ragged last split (two
# tiles a split, both read before the wait; the last split's second one all masked), K in three
# tiles (two early, a ragged third), and the tensor-core path with a split; N and K below are
# multiples of none of the blocks
def cpu_configs(gemv):
    return {
        "heuristic": None,
        "split": gemv.GemvConfig(block_n=8, block_k=32, split_k=2),
        "three_tiles": gemv.GemvConfig(block_n=4, block_k=32),
        "dot_split": gemv.GemvConfig(block_n=16, block_k=32, split_k=2, dot=True),
    }


def test_two_early_tiles_rule(gemv):
    """Two weight tiles before the wait exactly when a program's K is two or three FMA tiles:
    the interpreter configs above take it (K 72: splits of 64, or 96 in one)."""
    cfgs = cpu_configs(gemv)
    assert gemv.two_early(cfgs["split"], 64) and gemv.two_early(cfgs["three_tiles"], 96)
    assert not gemv.two_early(cfgs["three_tiles"], 32)  # one tile
    assert not gemv.two_early(cfgs["three_tiles"], 128)  # four: Qwen3-8B's lost with it
    assert not gemv.two_early(cfgs["dot_split"], 64)  # the dot path pipelines its own loads


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs the model's")
@pytest.mark.parametrize("config", ["heuristic", "split", "three_tiles", "dot_split"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_interpreted(gemv, dtype, config):
    cfg = cpu_configs(gemv)[config]
    for m, bias in [(1, False), (3, True), (8, True)]:
        x, w, b = problem(m, 37, 72, dtype, seed=m, bias=bias)
        check(gemv.gemv(x, w, b, config=cfg), reference(x, w, b))
        # gate rows [0, 19), up rows [19, 38)
        x, w, b = problem(m, 38, 72, dtype, seed=10 + m, bias=bias)
        check(gemv.gemv_silu_and_mul(x, w, b, config=cfg), reference(x, w, b, silu=True))


@pytest.mark.skipif(CUDA, reason="the interpreter's shapes; CUDA runs the model's")
@pytest.mark.parametrize("config", ["heuristic", "dot_split"])
def test_gemv_interpreted_up_to_64_rows(gemv, config):
    """Batches beyond GEMV_MAX_M (MINISGL_GEMV_MAX_M lets the layers send them): tensor-core
    tiles of 16, 64 (33 rows: padded) and 64 rows of x."""
    cfg = cpu_configs(gemv)[config]
    for m in (9, 16, 33, 64):
        x, w, b = problem(m, 37, 72, torch.float32, seed=m, bias=True)
        check(gemv.gemv(x, w, b, config=cfg), reference(x, w, b))
        x, w, b = problem(m, 38, 72, torch.float16, seed=10 + m)
        check(gemv.gemv_silu_and_mul(x, w, b, config=cfg), reference(x, w, b, silu=True))


@pytest.mark.skipif(CUDA, reason="interpreter shapes")
def test_gemv_shapes_and_strides(gemv):
    x, w, b = problem(6, 24, 40, torch.float32, seed=3, bias=True)
    x3 = x.view(2, 3, 40)  # leading dims are kept
    check(gemv.gemv(x3, w, b), reference(x3, w, b))
    xs = torch.randn(4, 80)[:, ::2]  # a strided last dim is copied first
    check(gemv.gemv(xs, w), reference(xs, w, None))
    assert gemv.gemv(x[:0], w).shape == (0, 24)
    wide = torch.randn(2, 40)[:, :17]  # rows with a stride: x's row stride is honoured
    w17 = torch.randn(5, 17)
    check(gemv.gemv(wide, w17), reference(wide, w17, None))


@pytest.mark.skipif(CUDA, reason="interpreter shapes")
def test_gemv_refuses_bad_input(gemv):
    x, w, _ = problem(2, 8, 16, torch.float32, seed=4)
    cases = [
        (lambda: gemv.gemv(torch.randn(65, 16), w), "more than GEMV_KERNEL_MAX_M = 64"),
        (lambda: gemv.gemv(x, torch.randn(8, 12)), r"x \(2, 16\) vs weight \(8, 12\)"),
        (lambda: gemv.gemv(x.half(), w), "must share one of"),
        (lambda: gemv.gemv(x, w.t().contiguous().t()), "contiguous"),
        (lambda: gemv.gemv(x, w, torch.zeros(7)), r"bias \(7,\) for 8 rows"),
        (lambda: gemv.gemv_silu_and_mul(x, torch.randn(7, 16)), "odd 7 rows"),
    ]
    for call, message in cases:
        with pytest.raises(AssertionError, match=message):
            call()
    for bad in [dict(block_n=3, block_k=32), dict(block_n=8, block_k=32, dot=True)]:
        with pytest.raises(ValueError, match="powers of two"):
            gemv.GemvConfig(**bad)


def test_heuristic_configs_are_valid():
    pytest.importorskip("triton")
    from minisgl.kernel.gemv import block_m, heuristic

    for rows, k in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]:
        for m in (1, 2, 4, 8):
            silu = rows == 6144
            cfg = heuristic(rows, k, block_m(m), 132, silu)
            assert k % cfg.block_k == 0 and cfg.block_k >= 128, cfg
            if cfg.dot:  # tl.dot's minimum tile
                assert cfg.block_n >= 16 and m > 2
            else:  # about 4096 float32 accumulators a program
                assert block_m(m) * cfg.block_n * cfg.block_k * (2 if silu else 1) == 4096
            # enough programs for the SMs, or as many splits as whole tiles allow
            programs = -(-rows // (2 if silu else 1) // cfg.block_n)
            assert programs * cfg.split_k >= 2 * 132 or 2 * cfg.split_k > k // cfg.block_k
            assert cfg.split_k * cfg.block_k <= k


def test_eligibility_rule(monkeypatch):
    monkeypatch.delenv("MINISGL_DISABLE_GEMV", raising=False)
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS", raising=False)
    w = torch.zeros(5, 16)
    for shape, expected in [((1, 16), True), ((8, 16), True), ((9, 16), False)]:
        assert kernel.gemv_eligible(torch.zeros(shape), w) is expected, shape
    assert kernel.gemv_eligible(torch.zeros(2, 4, 16), w)  # 8 rows after flattening
    assert not kernel.gemv_eligible(torch.zeros(3, 3, 16), w)
    assert not kernel.gemv_eligible(torch.zeros(1, 16, dtype=torch.float16), w)
    assert not kernel.gemv_eligible(torch.zeros(1, 16, dtype=torch.float64), w.double())
    assert not kernel.gemv_eligible(torch.zeros(1, 16), torch.zeros(16, 5).t())
    assert not kernel.gemv_eligible(torch.zeros(1, 0), torch.zeros(5, 0))
    assert not kernel.gemv_eligible(torch.zeros(1, 15), w)  # F.linear raises its own error
    assert kernel.gemv_ops(torch.zeros(1, 16), w) is None  # CPU: F.linear
    monkeypatch.setenv("MINISGL_DISABLE_GEMV", "1")
    assert flags.disable_gemv() and not kernel.gemv_eligible(torch.zeros(1, 16), w)
    monkeypatch.setenv("MINISGL_DISABLE_GEMV", "0")
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "yes")
    assert not kernel.gemv_eligible(torch.zeros(1, 16), w)
    monkeypatch.setenv("MINISGL_DISABLE_GEMV", "sometimes")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_GEMV='sometimes'"):
        flags.disable_gemv()


def test_gemv_max_m(monkeypatch):
    """MINISGL_GEMV_MAX_M moves the rows bound (default GEMV_MAX_M) up to GEMV_KERNEL_MAX_M;
    anything else is refused with the variable's name."""
    for flag in ("MINISGL_DISABLE_GEMV", "MINISGL_DISABLE_FUSED_OPS", "MINISGL_GEMV_MAX_M"):
        monkeypatch.delenv(flag, raising=False)
    w = torch.zeros(5, 16)
    assert kernel.gemv_max_m() == kernel.GEMV_MAX_M == 8
    monkeypatch.setenv("MINISGL_GEMV_MAX_M", "32")
    assert kernel.gemv_max_m() == 32
    assert kernel.gemv_eligible(torch.zeros(32, 16), w)
    assert not kernel.gemv_eligible(torch.zeros(33, 16), w)
    monkeypatch.setenv("MINISGL_GEMV_MAX_M", "64")
    assert kernel.gemv_eligible(torch.zeros(4, 16, 16), w)
    for bad, message in [("65", "at most 64 rows"), ("0", "whole number"), ("8.5", "whole")]:
        monkeypatch.setenv("MINISGL_GEMV_MAX_M", bad)
        with pytest.raises(ValueError, match=f"MINISGL_GEMV_MAX_M=.*{message}"):
            kernel.gemv_eligible(torch.zeros(1, 16), w)


def layers(dtype: torch.dtype):
    """A biased column linear, a row-parallel linear, an MLP and an LM head, seeded."""
    torch.manual_seed(0)
    mods = [ReplicatedLinear(24, 20, bias=True), RowParallelLinear(24, 12), MLP(24, 20)]
    mods.append(ParallelLMHead(50, 24))
    for mod in mods:
        for p in mod.parameters():
            p.data = (torch.randn(p.shape) / 5).to(DEVICE, dtype)
    return mods


def references(mods, x: torch.Tensor) -> list[torch.Tensor]:
    lin, row, mlp, head = mods
    up = mlp.gate_up_proj
    return [
        F.linear(x, lin.weight, lin.bias),
        F.linear(x, row.weight),
        F.linear(silu_and_mul_torch(F.linear(x, up.weight)), mlp.down_proj.weight),
        F.linear(x, head.weight),
    ]


def spy_gemv(monkeypatch, gemv, on_any_device: bool) -> list[str]:
    """Record each GEMV launch (by entry point). Off CUDA, `gemv_ops` applies the eligibility
    rule to CPU tensors (the kernels run interpreted), so the layers' wiring is tested."""
    calls: list[str] = []
    for name in ("gemv", "gemv_silu_and_mul"):
        real = getattr(gemv, name)
        monkeypatch.setattr(
            gemv,
            name,
            lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw),
        )
    if on_any_device:
        monkeypatch.setattr(
            kernel, "gemv_ops", lambda x, w: gemv if kernel.gemv_eligible(x, w) else None
        )
    return calls


@pytest.mark.parametrize(
    "flag", [None, "MINISGL_DISABLE_GEMV", "MINISGL_DISABLE_FUSED_OPS", "MINISGL_GEMV_MAX_M"]
)
def test_layers_dispatch(gemv, monkeypatch, flag):
    """M <= 8: every layer (and the MLP's fused gate_up + SiLU) takes the GEMV and matches
    F.linear; M = 9 or a flag: F.linear, bit for bit; with MINISGL_GEMV_MAX_M=16, M = 9 and 16
    take the GEMV and M = 17 F.linear."""
    for name in ("MINISGL_DISABLE_GEMV", "MINISGL_DISABLE_FUSED_OPS", "MINISGL_GEMV_MAX_M"):
        monkeypatch.delenv(name, raising=False)
    if flag:
        monkeypatch.setenv(flag, "16" if flag == "MINISGL_GEMV_MAX_M" else "1")
    calls = spy_gemv(monkeypatch, gemv, on_any_device=not CUDA)
    mods = layers(torch.float32)
    gen = torch.Generator().manual_seed(1)
    sizes = (1, 3, 9, 16, 17) if flag == "MINISGL_GEMV_MAX_M" else (1, 3, 9)
    for m in sizes:  # FMA, tensor-core dot, F.linear
        x = torch.randn(m, 24, generator=gen).to(DEVICE)
        calls.clear()
        with torch.inference_mode():
            outs = [mod(x) for mod in mods]
        disabled = flag is not None and flag != "MINISGL_GEMV_MAX_M"
        fallback = m > kernel.gemv_max_m() or disabled
        for out, ref in zip(outs, references(mods, x)):
            if fallback and not CUDA:  # CUDA's SiLU-and-mul is a Triton kernel: not bit-exact
                assert torch.equal(out, ref)
            else:
                check(out, ref)
        expected = ["gemv", "gemv", "gemv_silu_and_mul", "gemv", "gemv"]
        assert calls == ([] if fallback else expected)


# ---- GPU ----------------------------------------------------------------------------------

# Qwen3-0.6B: (rows of W, K, fused SiLU): qkv, o, gate_up (+ SiLU), down, LM head
QWEN3_SHAPES = [
    (4096, 1024, False),
    (1024, 2048, False),
    (6144, 1024, True),
    (1024, 3072, False),
    (151936, 1024, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", QWEN3_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}{'_silu' * s[2]}")
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16, 33, 64])
def test_gemv_qwen3_shapes_on_gpu(gemv, shape, m, dtype):
    rows, k, silu = shape
    x, w, b = problem(m, rows, k, dtype, seed=m, bias=rows == 4096)  # qkv bias as Qwen2 has
    fn = gemv.gemv_silu_and_mul if silu else gemv.gemv
    check(fn(x, w, b), reference(x, w, b, silu))


@pytest.mark.gpu
def test_every_benchmark_candidate_on_gpu(gemv):
    """Each config the benchmark may recommend computes the right thing (at M 1 and 8)."""
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "kernels"))
    from gemv_bench import candidates

    for rows, k, silu in QWEN3_SHAPES[:4]:
        for m in (1, 8):
            x, w, b = problem(m, rows, k, torch.bfloat16, seed=5)
            fn = gemv.gemv_silu_and_mul if silu else gemv.gemv
            for cfg in candidates(rows, k, m, silu):
                try:
                    check(fn(x, w, config=cfg), reference(x, w, b, silu))
                except AssertionError as e:
                    raise AssertionError(f"{rows}x{k} m={m} {cfg}: {e}") from None


@pytest.mark.gpu
def test_gemv_in_cuda_graph(gemv):
    """Captured with split-K (partials + reduce) and replayed on new inputs."""
    x, w, b = problem(2, 1024, 3072, torch.bfloat16, seed=6, bias=True)
    cfg = gemv.GemvConfig(block_n=8, block_k=256, split_k=4)
    gemv.gemv(x, w, b, config=cfg)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv.gemv(x, w, b, config=cfg)
    x.copy_(torch.randn_like(x))
    graph.replay()
    check(out, reference(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_model_greedy_gemv_on_equals_off(gemv, model_dirs, monkeypatch, arch):
    """Tiny models in float32 on CUDA, CUDA graphs on (decode batches 1..8 replay graphs that
    hold the GEMV): the same greedy tokens with MINISGL_DISABLE_GEMV=1 and without."""
    from minisgl import LLM, SamplingParams

    path, _ = model_dirs(arch)
    prompts = [[5, 17, 300, 42, 7], list(range(100, 123)), [9] * 11]

    def generate() -> list[list[int]]:
        llm = LLM(path, device="cuda:0", dtype="float32", page_size=16, num_pages=64)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=12), use_tqdm=False)
            one = llm.generate(prompts[:1], SamplingParams(max_tokens=12), use_tqdm=False)
        finally:
            llm.shutdown()
        return [o["token_ids"] for o in outs + one]

    monkeypatch.setenv("MINISGL_DISABLE_GEMV", "1")
    expected = generate()
    monkeypatch.delenv("MINISGL_DISABLE_GEMV")
    calls = spy_gemv(monkeypatch, gemv, on_any_device=False)
    assert generate() == expected
    assert "gemv" in calls and "gemv_silu_and_mul" in calls


@pytest.mark.skipif(CUDA, reason="the smoke run is the CPU one")
def test_benchmark_smoke(gemv):
    """benchmark/kernels/gemv_bench.py --smoke starts, runs interpreted and prints a table."""
    import subprocess

    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "kernels", "gemv_bench.py"), "--smoke"]
    env_vars = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env_vars)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "GB/s" in proc.stdout and "best" in proc.stdout, proc.stdout[-2000:]
