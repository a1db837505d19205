"""GPU attention backends (triton, fi) against the torch reference backend on random paged KV:
prefill with a cached prefix, decode, mixed lengths, page sizes 1 and 16; and the CUDA-graph
decode path (capture once, replay other batches) against eager prepare + forward.
fi cases skip when flashinfer does not import."""

from __future__ import annotations

import pytest
import torch

from minisgl.attention import create_attention_backend, flashinfer_available
from minisgl.context import get_global_ctx, set_global_ctx
from minisgl.core import Batch, Req, SamplingParams
from support.attn import attend, make_problem, max_diff, run_backend

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda", 0)
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}
BACKENDS = ["triton", "fi"]

DECODE_LENS = [(0, 1), (5, 1), (16, 1), (17, 1), (300, 1), (1000, 1), (2049, 1)]
# prefill: fresh prompts, cached prefixes (page-aligned or not), chunks of one token
EXTEND_LENS = [(0, 1), (0, 37), (16, 16), (13, 70), (100, 5), (250, 129), (3, 1)]
# a prefill batch mixing decode-like rows, a long fresh prompt and long prefixes
MIXED_LENS = [(1000, 1), (0, 300), (37, 1), (512, 100), (5, 3), (2047, 2)]
CASES = {
    "decode": (DECODE_LENS, True),
    "extend": (EXTEND_LENS, False),
    "mixed": (MIXED_LENS, False),
}
# (query heads, kv heads): GQA group 4 (fi decodes on tensor cores) and group 2 as in
# Qwen3-0.6B (fi's CUDA-core decode kernel)
HEADS = {"gqa4": (8, 2), "gqa2": (16, 8)}


@pytest.fixture(autouse=True)
def _no_global_ctx():
    yield
    set_global_ctx(None)


def need(name: str) -> None:
    if "fi" in name.split(",") and not flashinfer_available():
        pytest.skip("flashinfer does not import")


def compare(
    name, case, page_size, head_dim, dtype, heads="gqa4", sliding_window=None, kv_dtype=None
):
    lens, decode = CASES[case]
    h, hk = HEADS[heads] if isinstance(heads, str) else heads
    batch, q, k, v = make_problem(
        lens, page_size, head_dim, dtype, decode, DEVICE, h, hk, kv_dtype=kv_dtype
    )
    ref = run_backend("torch", batch, q, k, v, sliding_window)
    out = run_backend(name, batch, q, k, v, sliding_window)
    diff = max_diff(out, ref)
    what = f"{case}, page_size {page_size}, head_dim {head_dim}, {heads}, {dtype}, kv {kv_dtype}"
    print(f"{name} {what}: max abs diff {diff:.3g}")
    assert diff <= TOL[dtype], f"{name} vs torch backend ({what}): {diff:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_torch(name, case, page_size, heads, head_dim, dtype):
    need(name)
    if name == "fi" and dtype == torch.float32:
        pytest.skip("flashinfer has no float32 (refused, see test_attention.py)")
    if name == "fi" and head_dim != 128:
        pytest.skip("fi runs at head_dim 128 only: each head_dim is another JIT build")
    compare(name, case, page_size, head_dim, dtype, heads)


@pytest.mark.parametrize("heads", [(14, 2), (32, 2), (4, 4)])
@pytest.mark.parametrize("case", ["extend", "mixed"])
def test_triton_extend_any_group(case, heads):
    """The extend kernel at GQA groups 7 (Qwen2.5-0.5B's 14 / 2 heads) and 16, and without
    GQA."""
    compare("triton", case, 16, 128, torch.bfloat16, heads)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(CASES))
def test_triton_fp8_kv_matches_torch(case, page_size, heads, kv_dtype):
    """--kv-cache-dtype fp8: the new tokens' K/V are cast into the pool by the store, and both
    backends widen the same 8-bit values on load."""
    compare("triton", case, page_size, 128, torch.bfloat16, heads, kv_dtype=kv_dtype)


@pytest.mark.parametrize("case", list(CASES))
def test_fi_sliding_window_matches_torch(case):
    need("fi")
    compare("fi", case, 16, 128, torch.bfloat16, "gqa2", sliding_window=100)


@pytest.mark.parametrize("case", ["decode", "extend"])
def test_hybrid_matches_torch(case):
    need("fi")
    compare("fi,triton", case, 16, 128, torch.bfloat16)
    compare("triton,fi", case, 16, 128, torch.bfloat16)


# the steps the pair's fi prefill sends through the ragged kernel (ext/perf/ragged.py): fresh
# prompts, and mixed steps as the scheduler lays them out, decode rows first (one token each:
# Triton's decode kernel; several, as speculative verification has: fi's paged kernel)
RAGGED = {
    "fresh": ([(0, 37), (0, 300), (0, 1), (0, 129)], 0),
    "mixed": ([(1000, 1), (37, 1), (2047, 1), (0, 300), (512, 700), (5, 3), (16, 16), (0, 1)], 3),
    "verify": ([(500, 3), (37, 2), (0, 300), (100, 700)], 2),
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", list(RAGGED))
def test_fi_ragged_prefill_matches_torch(case, page_size):
    need("fi")
    from minisgl.ext.perf.ragged import RaggedMetadata

    lens, decodes = RAGGED[case]
    batch, q, k, v = make_problem(lens, page_size, 128, torch.bfloat16, False, DEVICE, 16, 8)
    batch.num_decodes = decodes
    ref = run_backend("torch", batch, q, k, v)
    backend = create_attention_backend("fi,triton", DEVICE, dtype=q.dtype, num_qo_heads=16)
    backend.prepare(batch)
    assert isinstance(batch.attn_metadata, RaggedMetadata)
    diff = max_diff(attend(backend, batch, q, k, v), ref)
    assert diff <= TOL[torch.bfloat16], f"ragged fi prefill vs torch ({case}): {diff:.3g}"


def test_triton_single_long_request_uses_splits():
    batch, q, k, v = make_problem([(4000, 1)], 16, 128, torch.bfloat16, True, DEVICE)
    ref = run_backend("torch", batch, q, k, v)
    out = run_backend("triton", batch, q, k, v)
    assert batch.attn_metadata.num_splits > 1, "batch 1 should split its KV over the SMs"
    assert max_diff(out, ref) <= TOL[torch.bfloat16]


def test_auto_on_cuda():
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.attention.triton_backend import TritonAttnBackend

    def auto(dtype, window=None):
        return create_attention_backend("auto", DEVICE, window, dtype=dtype, num_qo_heads=8)

    from minisgl.extension import extensions

    hopper = torch.cuda.get_device_capability(DEVICE)[0] == 9
    if hopper and flashinfer_available() and extensions().auto_prefill is not None:
        assert auto(torch.bfloat16).name == "fi,triton"  # FA3's prefill, Triton's decode
    else:
        assert isinstance(auto(torch.bfloat16), TritonAttnBackend)  # measured faster than fi
    assert isinstance(auto(torch.float32), TritonAttnBackend)
    assert isinstance(auto(torch.float32, 4096), TorchAttnBackend)
    assert auto(torch.bfloat16, 4096).name == ("fi" if flashinfer_available() else "torch")


def decode_req(row: int, kv_len: int) -> Req:
    req = Req([0] * kv_len, kv_len, SamplingParams(), kv_len + 1)
    req.table_idx, req.cached_len, req.extend_len = row, kv_len - 1, 1
    return req


def slots_of(reqs: list[Req]) -> torch.Tensor:
    ctx = get_global_ctx()
    table, ps = ctx.page_table.cpu(), ctx.page_size
    loc = [table[r.table_idx, r.cached_len // ps].item() * ps + r.cached_len % ps for r in reqs]
    return torch.tensor(loc, device=DEVICE)


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", BACKENDS)
def test_decode_graph_replay_matches_eager(name, page_size, heads):
    """Capture one layer's decode forward at batch size 5, replay it for other batches of 5
    (other rows, other KV lengths, a padding request on the spare row) and compare with a
    fresh backend's eager prepare + forward and with the torch backend."""
    need(name)
    dtype, head_dim = torch.bfloat16, 128
    lens = [(0, 1), (40, 1), (1500, 1), (15, 1), (700, 1)]
    batch, q, k, v = make_problem(lens, page_size, head_dim, dtype, True, DEVICE, *HEADS[heads])
    rows = [r.table_idx for r in batch.reqs]
    backend = create_attention_backend(name, DEVICE, dtype=dtype, num_qo_heads=q.shape[1])
    backend.init_cuda_graph(8)
    static_q, static_k, static_v = q.clone(), k.clone(), v.clone()
    static_loc = batch.out_loc.clone()
    captured = Batch(batch.reqs, "decode", out_loc=static_loc)
    backend.prepare_for_capture(captured)
    side = torch.cuda.Stream()  # warm-up (kernel compile / load) outside the capture
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attend(backend, captured, static_q, static_k, static_v)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = attend(backend, captured, static_q, static_k, static_v)

    replays = {
        "captured batch": list(zip(rows, [c + 1 for c, _ in lens])),
        "other rows and lengths": list(zip(rows[::-1], [1501, 3, 1200, 64, 17])),
        "padded with a dummy row": list(zip([rows[2], rows[0], 0, 0, 0], [900, 33, 1, 1, 1])),
    }
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    for what, pairs in replays.items():
        reqs = [decode_req(row, n) for row, n in pairs]
        loc = slots_of(reqs)
        q2, k2, v2 = (
            torch.randn(t.shape, generator=gen, device=DEVICE, dtype=dtype) for t in (q, k, v)
        )
        for static, new in ((static_q, q2), (static_k, k2), (static_v, v2), (static_loc, loc)):
            static.copy_(new)
        backend.prepare_for_replay(Batch(reqs, "decode", out_loc=static_loc))
        graph.replay()
        got = static_out.clone()
        eager = run_backend(name, Batch(reqs, "decode", out_loc=loc), q2, k2, v2)
        ref = run_backend("torch", Batch(reqs, "decode", out_loc=loc), q2, k2, v2)
        # padding requests all write slot 0 of the dummy page (last writer unknown): skip them
        real = [i for i, (row, _) in enumerate(pairs) if row != 0]
        for against, want in (("eager", eager), ("torch backend", ref)):
            diff = max_diff(got[real], want[real])
            case = f"{name} decode graph replay ({what}, page_size {page_size}, {heads})"
            print(f"{case} vs {against}: max abs diff {diff:.3g}")
            assert diff <= TOL[dtype], f"{case} vs {against}: {diff:.3g} > {TOL[dtype]}"


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("num_splits", [1, 7, 32])
@pytest.mark.parametrize("norm", [False, True])
def test_rope_inside_decode_equals_rotary_kernel_then_decode(kv_dtype, num_splits, norm):
    """DecodeRope: the decode kernel rotating q itself and writing the new token's k and v
    (from the split that reads it, behind a barrier) gives what the rotary kernel + decode
    give, at Qwen3-0.6B's heads, one split and many (the new token in the last split used)."""
    from support.attn import rope_inside_vs_rotary_kernel

    lens = [1, 17, 300, 1000, 2049, 4000]
    diff, same_pool = rope_inside_vs_rotary_kernel(
        torch.bfloat16, kv_dtype, norm, lens, num_splits, DEVICE, 16, 8, 128, 16
    )
    assert same_pool, "the pools differ"
    assert diff <= 1e-2, diff  # the same values; only the rounding of fused multiply-adds may move


def test_fi_decode_bench_agrees_with_the_triton_kernel(capsys):
    """benchmark/kernels/fi_decode_bench.py: both kernels on the same pages (bf16 and fp8)
    match the float32 reference and are timed as graph replays."""
    if not flashinfer_available():
        pytest.skip("flashinfer does not import")
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmark", "kernels"))
    from fi_decode_bench import main

    assert main(["--batch", "3,20", "--min-len", "1", "--max-len", "300"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if " requests: " in line]
    assert len(lines) == 4 and all(line.count("max error") == 2 for line in lines)
    assert not any("WRONG" in line for line in lines), lines
