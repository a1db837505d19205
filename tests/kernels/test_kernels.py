"""The Triton fused ops (kernel/fused.py) against their torch references: on CUDA at Qwen3-0.6B
shapes, otherwise on small shapes under the Triton interpreter (TRITON_INTERPRET=1, CPU
tensors). Skipped where triton is not installed; the env flag and dispatch tests always run."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, kernel
from minisgl.kernel import flags
from minisgl.kvcache.pool import store_kv_torch
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.norm import RMSNorm, rms_norm_torch
from minisgl.layers.rotary import RopeConfig, RotaryEmbedding, rotate_halves
from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (atol, rtol): the kernels round once from float32, the references after each op; the
# interpreter also truncates float32 -> bf16 (the GPU rounds to nearest even)
TOL = {torch.bfloat16: (3e-2, 1.6e-2), torch.float16: (4e-3, 2e-3), torch.float32: (2e-5, 1e-5)}
# (tokens, hidden, q heads, kv heads, head_dim, intermediate): Qwen3-0.6B on CUDA, tiny and
# non-power-of-two under the interpreter (it runs one Python loop iteration per program)
SHAPES = (
    [(1, 1024, 16, 8, 128, 3072), (37, 1024, 16, 8, 128, 3072), (256, 1024, 16, 8, 128, 3072)]
    + [(8192, 1024, 16, 8, 128, 3072)]
    if CUDA
    else [(1, 64, 4, 2, 16, 128), (5, 96, 3, 1, 24, 80)]
)
DEVICE = torch.device("cuda" if CUDA else "cpu")


def rope_torch(
    q: torch.Tensor, k: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference neox RoPE (as transformers: cos/sin cast to x's dtype first)."""
    cos, sin = cos_sin[positions].to(q.dtype).unsqueeze(1).chunk(2, dim=-1)
    return rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@pytest.fixture(scope="module")
def ops():
    return kernel_module("fused")


def close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    atol, rtol = TOL[out.dtype]
    excess = (out.float() - ref.float()).abs() - rtol * ref.float().abs()
    worst = excess.max().item() if out.numel() else 0.0
    assert worst <= atol, f"error exceeds rtol {rtol} by {worst:.3g} > atol {atol}"


def randn(*shape: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(DEVICE, dtype)


def qkv_views(tokens: int, hq: int, hk: int, dim: int, dtype: torch.dtype, seed: int):
    """q, k, v as the strided views of one fused qkv output, as the attention layer makes."""
    qkv = randn(tokens, (hq + 2 * hk) * dim, dtype=dtype, seed=seed)
    q, k, v = qkv.split([hq * dim, hk * dim, hk * dim], dim=-1)
    return qkv, q.view(-1, hq, dim), k.view(-1, hk, dim), v.view(-1, hk, dim)


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(ops, shape, dtype):
    tokens, hidden, hq, hk, dim, _ = shape
    x = randn(tokens, hidden, dtype=dtype, seed=1) * 3
    w = randn(hidden, dtype=dtype, seed=2)
    close(ops.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6))
    # Qwen3's q-norm: [T, heads, head_dim] rows of a strided view
    _, q, _, _ = qkv_views(tokens, hq, hk, dim, dtype, seed=3)
    wq = randn(dim, dtype=dtype, seed=4)
    close(ops.rms_norm(q, wq, 1e-5), rms_norm_torch(q, wq, 1e-5))


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_add_rms_norm_in_place(ops, shape, dtype):
    tokens, hidden = shape[:2]
    x = randn(tokens, hidden, dtype=dtype, seed=5)
    res = randn(tokens, hidden, dtype=dtype, seed=6) * 4
    w = randn(hidden, dtype=dtype, seed=7)
    ref_res = x + res
    ref = rms_norm_torch(ref_res, w, 1e-6)
    ops.add_rms_norm_(x, res, w, 1e-6)
    close(res, ref_res)
    close(x, ref)


@on_device
@pytest.mark.parametrize("pos_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_in_place_on_qkv_views(ops, shape, dtype, pos_dtype):
    tokens, _, hq, hk, dim, _ = shape
    rope = RotaryEmbedding(RopeConfig(dim, base=1e6, max_position=4096)).to(DEVICE)
    gen = torch.Generator().manual_seed(tokens)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    positions[-1] = 4095  # the last row of cos_sin
    positions = positions.to(DEVICE, pos_dtype)
    qkv, q, k, v = qkv_views(tokens, hq, hk, dim, dtype, seed=8)
    ref_q, ref_k = rope_torch(q, k, rope.cos_sin, positions.long())
    v_before = v.clone()
    ops.rotary_(q, k, rope.cos_sin, positions)
    close(q, ref_q)
    close(k, ref_k)
    assert torch.equal(v, v_before)  # the v columns of the shared buffer are untouched


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_qk_norm_fused_into_rotary(ops, shape, dtype):
    """Qwen3's per-head q/k RMSNorm in the rotary pass equals rms_norm() then rotary_() and the
    torch path (norm, then rope) within tolerance (only the sum order differs)."""
    tokens, _, hq, hk, dim, _ = shape
    rope = RotaryEmbedding(RopeConfig(dim, base=1e6, max_position=4096)).to(DEVICE)
    positions = torch.randint(0, 4096, (tokens,), generator=torch.Generator().manual_seed(3))
    positions = positions.to(DEVICE)
    q_w = randn(dim, dtype=dtype, seed=11) * 0.2 + 1
    k_w = randn(dim, dtype=dtype, seed=12) * 0.2 + 1
    _, q, k, v = qkv_views(tokens, hq, hk, dim, dtype, seed=10)
    ref_q, ref_k = rope_torch(
        rms_norm_torch(q, q_w, 1e-6), rms_norm_torch(k, k_w, 1e-6), rope.cos_sin, positions
    )
    two_q, two_k = ops.rms_norm(q, q_w, 1e-6), ops.rms_norm(k, k_w, 1e-6)
    ops.rotary_(two_q, two_k, rope.cos_sin, positions)
    v_before = v.clone()
    ops.rotary_(q, k, rope.cos_sin, positions, (q_w, k_w, 1e-6))
    close(q, two_q)
    close(k, two_k)
    close(q, ref_q)
    close(k, ref_k)
    assert torch.equal(v, v_before)


@on_device
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "qk_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rotary_store_kv(ops, shape, dtype, qk_norm, index_dtype):
    """RoPE (+ q/k norm) with the K/V store in the same pass equals the torch path (norm, rope,
    store_kv_torch): q rotated in place, the rotated k and the untouched v at out_loc of a paged
    pool (scattered slots), every other slot and the qkv buffer's k/v columns left alone."""
    tokens, _, hq, hk, dim, _ = shape
    rope = RotaryEmbedding(RopeConfig(dim, base=1e6, max_position=4096)).to(DEVICE)
    gen = torch.Generator().manual_seed(tokens + 7)
    positions = torch.randint(0, 4096, (tokens,), generator=gen).to(DEVICE, index_dtype)
    page_size, num_pages = 4, tokens // 4 + 2  # a few slots to spare, the rest written
    out_loc = torch.randperm(num_pages * page_size, generator=gen)[:tokens].to(DEVICE)
    qkv, q, k, v = qkv_views(tokens, hq, hk, dim, dtype, seed=13)
    # [K | V, pages, page_size, kv_heads, head_dim] of noise, seen as flat [slots, Hk, D]
    pools = randn(2, num_pages, page_size, hk, dim, dtype=dtype, seed=14)
    k_pool, v_pool = pools[0].view(-1, hk, dim), pools[1].view(-1, hk, dim)
    norm = None
    ref_q, ref_k = q, k
    if qk_norm:
        norm = (randn(dim, dtype=dtype, seed=15) * 0.2 + 1, randn(dim, dtype=dtype, seed=16), 1e-6)
        ref_q, ref_k = rms_norm_torch(q, norm[0], 1e-6), rms_norm_torch(k, norm[1], 1e-6)
    ref_q, ref_k = rope_torch(ref_q, ref_k, rope.cos_sin, positions.long())
    ref_pools = pools.clone()
    store_kv_torch(
        ref_pools[0].view(-1, hk, dim), ref_pools[1].view(-1, hk, dim), out_loc, ref_k, v
    )
    kv_before = qkv[:, hq * dim :].clone()
    loc = out_loc.to(index_dtype)
    ops.rotary_store_kv(q, k, v, rope.cos_sin, positions, k_pool, v_pool, loc, norm)
    close(q, ref_q)
    close(k_pool[out_loc], ref_k)
    assert torch.equal(v_pool[out_loc], v)  # a copy: bit-exact
    kept = torch.ones(num_pages * page_size, dtype=torch.bool, device=DEVICE)
    kept[out_loc] = False
    kept = kept.view(num_pages, page_size)
    assert torch.equal(pools[:, kept], ref_pools[:, kept])
    assert torch.equal(qkv[:, hq * dim :], kv_before)  # k and v are only read


@on_device
def test_rotary_store_kv_casts_to_the_pool_dtype(ops):
    """float32 k/v into a float16 pool, as store_kv casts; an empty batch launches nothing."""
    tokens, hq, hk, dim = 3, 2, 2, 8
    rope = RotaryEmbedding(RopeConfig(dim, max_position=64)).to(DEVICE)
    positions = torch.tensor([0, 5, 63], device=DEVICE)
    _, q, k, v = qkv_views(tokens, hq, hk, dim, torch.float32, seed=17)
    pools = torch.zeros(2, 10, hk, dim, dtype=torch.float16, device=DEVICE)
    out_loc = torch.tensor([9, 2, 4], device=DEVICE)
    ref_q, ref_k = rope_torch(q, k, rope.cos_sin, positions)
    ref = pools.clone()
    store_kv_torch(ref[0], ref[1], out_loc, ref_k, v)
    ops.rotary_store_kv(q, k, v, rope.cos_sin, positions, pools[0], pools[1], out_loc)
    close(q, ref_q)
    close(pools, ref)
    empty = [x[:0] for x in (q, k, v, positions)]
    ops.rotary_store_kv(*empty[:3], rope.cos_sin, empty[3], pools[0], pools[1], out_loc[:0])
    with pytest.raises(AssertionError, match="out_loc"):
        ops.rotary_store_kv(q, k, v, rope.cos_sin, positions, pools[0], pools[1], out_loc[:2])


@on_device
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_silu_and_mul(ops, shape, dtype):
    tokens, inter = shape[0], shape[5]
    x = randn(tokens, 2 * inter, dtype=dtype, seed=9) * 3
    close(ops.silu_and_mul(x), silu_and_mul_torch(x))
    close(ops.silu_and_mul(x[:0]), silu_and_mul_torch(x[:0]))  # an expert with no tokens


@on_device
@pytest.mark.parametrize("src_dtype", [None, torch.float32], ids=["same", "from_fp32"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_store_kv(ops, shape, dtype, src_dtype):
    tokens, _, hq, hk, dim, _ = shape
    slots = 2 * tokens + 3
    gen = torch.Generator().manual_seed(tokens + 1)
    out_loc = torch.randperm(slots, generator=gen)[:tokens].to(DEVICE)
    _, _, k, v = qkv_views(tokens, hq, hk, dim, src_dtype or dtype, seed=10)
    pools = torch.zeros(2, slots, hk, dim, dtype=dtype, device=DEVICE)
    ref = pools.clone()
    store_kv_torch(ref[0], ref[1], out_loc, k, v)
    ops.store_kv(pools[0], pools[1], out_loc.int(), k, v)
    if CUDA or src_dtype is None or dtype != torch.bfloat16:
        assert torch.equal(pools, ref)  # a copy (and one rounding): bit-exact, others kept
    else:
        close(pools, ref)  # the interpreter truncates float32 -> bf16


@on_device
@pytest.mark.parametrize("batch", [1, 5, 1500])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_inputs_gather_ids_and_slots_like_the_reference(ops, batch, page_size):
    """fused.decode_inputs against the torch path of a decode step (engine/step.py): the token
    table's id at each (row, position) and `Context.kv_slots`, rows repeated and out of order."""
    from types import SimpleNamespace

    from minisgl.context import Context

    gen = torch.Generator().manual_seed(batch + page_size)
    num_rows, max_len = 7, 64
    tokens = torch.randint(0, 50_000, (num_rows, max_len + 1), generator=gen, dtype=torch.int32)
    pages = torch.randint(0, 4_000, (num_rows, max_len // page_size), generator=gen)
    tokens, pages = tokens.to(DEVICE), pages.int().to(DEVICE)
    rows = torch.randint(0, num_rows, (batch,), generator=gen).to(DEVICE)
    positions = torch.randint(0, max_len, (batch, 2), generator=gen).to(DEVICE)[:, 0]  # strided
    ids, slots = ops.decode_inputs(tokens, pages, rows, positions, page_size)
    ctx = SimpleNamespace(page_table=pages, page_size=page_size)
    assert torch.equal(ids, tokens[rows, positions])
    assert torch.equal(slots, Context.kv_slots(ctx, rows, positions))  # type: ignore[arg-type]


@on_device
@pytest.mark.parametrize("n_pages, n_tokens", [(0, 1), (3, 0), (16, 300), (300, 5)])
def test_write_table_entries_like_indexing(ops, n_pages, n_tokens):
    """fused.write_table_entries (the engine's queued TableWrites in one launch) against
    indexed writes: the first n_pages entries into the page table, the rest into the token
    table, every other entry of both tables untouched."""
    gen = torch.Generator().manual_seed(n_pages * 1000 + n_tokens)
    pages = torch.randint(0, 99, (9, 50), generator=gen, dtype=torch.int32)
    tokens = torch.randint(0, 99, (9, 400), generator=gen, dtype=torch.int32)

    def distinct(n: int, cols: int) -> torch.Tensor:  # n distinct (row, col) cells
        flat = torch.randperm(9 * cols, generator=gen)[:n]
        return torch.stack([flat // cols, flat % cols])

    cells = torch.cat([distinct(n_pages, 50), distinct(n_tokens, 400)], dim=1)
    values = torch.randint(1000, 2000, (1, n_pages + n_tokens), generator=gen)
    entries = torch.cat([cells, values]).int()
    ref_pages, ref_tokens = pages.clone(), tokens.clone()
    rows, cols = entries[0].long(), entries[1].long()
    ref_pages[rows[:n_pages], cols[:n_pages]] = entries[2, :n_pages]
    ref_tokens[rows[n_pages:], cols[n_pages:]] = entries[2, n_pages:]
    pages, tokens, entries = pages.to(DEVICE), tokens.to(DEVICE), entries.to(DEVICE)
    ops.write_table_entries(pages, tokens, entries.contiguous(), n_pages)
    assert torch.equal(pages.cpu(), ref_pages) and torch.equal(tokens.cpu(), ref_tokens)


def test_env_flags(monkeypatch):
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS", raising=False)
    assert not flags.disable_fused_ops()
    for value, expected in [("1", True), ("true", True), (" ON ", True), ("0", False)]:
        monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", value)
        assert flags.disable_fused_ops() is expected
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "yes")
    assert env.disable_overlap_scheduling()
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "maybe")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_FUSED_OPS='maybe'"):
        flags.disable_fused_ops()


def test_pdl_rule(monkeypatch):
    """Kernels launch with programmatic dependent launch only on sm_90+ CUDA devices, never
    under the interpreter or with MINISGL_DISABLE_PDL set (read at each launch)."""
    pytest.importorskip("triton")
    from minisgl.kernel import pdl

    assert not pdl.enabled(torch.device("cpu"))
    capability = {0: 9, 1: 8}  # an H100 and an A100, without touching CUDA
    monkeypatch.setattr(pdl, "_supported", lambda index: capability[index] >= 9)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("MINISGL_DISABLE_PDL", raising=False)
    assert pdl.enabled(torch.device("cuda", 0)) and not pdl.enabled(torch.device("cuda", 1))
    assert pdl.options(torch.device("cuda", 0)) == {"PDL": True, "launch_pdl": True}
    assert pdl.options(torch.device("cuda", 1)) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "1")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not pdl.enabled(torch.device("cuda", 0))
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "sometimes")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="MINISGL_DISABLE_PDL='sometimes'"):
        pdl.enabled(torch.device("cuda", 0))


def test_cpu_tensors_take_the_torch_path():
    assert kernel.fused_ops(torch.zeros(2)) is None


def check_norm_consumes_its_inputs(norm: RMSNorm, x: torch.Tensor, res: torch.Tensor):
    """RMSNorm's contract on every device: x's buffer receives the normed x + res and res's
    the sum; both are returned. -> (normed, new residual)"""
    x1, res1 = x.clone(), res.clone()
    out, new_res = norm(x1, res1)
    assert out.data_ptr() == x1.data_ptr() and new_res.data_ptr() == res1.data_ptr()
    return out, new_res


def test_rms_norm_consumes_its_inputs_on_cpu():
    """The torch path honours the kernels' in-place contract, with the very values of the
    out-of-place reference (x + residual, then normed: what transformers computes)."""
    norm = RMSNorm(64, 1e-6)
    norm.weight.data.copy_(torch.randn(64, generator=torch.Generator().manual_seed(13)))
    gen = torch.Generator().manual_seed(14)
    x, res = torch.randn(3, 64, generator=gen), torch.randn(3, 64, generator=gen)
    out, new_res = check_norm_consumes_its_inputs(norm, x, res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, rms_norm_torch(x + res, norm.weight, 1e-6))


@pytest.mark.gpu
def test_layers_dispatch_on_cuda(ops, monkeypatch):
    """On CUDA RMSNorm's residual add runs in the kernel; the flag restores the torch path,
    which keeps the same in-place contract."""
    norm = RMSNorm(64, 1e-6).to(DEVICE)
    x, res = randn(3, 64, dtype=torch.float32, seed=11), randn(3, 64, dtype=torch.float32, seed=12)
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS", raising=False)
    assert kernel.fused_ops(x) is ops
    out, new_res = check_norm_consumes_its_inputs(norm, x, res)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    assert kernel.fused_ops(x) is None
    ref, ref_res = check_norm_consumes_its_inputs(norm, x, res)
    close(out, ref)
    close(new_res, ref_res)


@on_device
# qk-norm and MoE (experts with no tokens) on CPU, where the interpreter is slow
@pytest.mark.parametrize(
    "arch", ["llama", "llama3_tied", "qwen3", "qwen3_moe"] if CUDA else ["qwen3", "qwen3_moe"]
)
def test_model_greedy_fused_equals_torch_path(ops, model_dirs, monkeypatch, arch):
    """Whole tiny models in float32: the same greedy tokens with the fused ops as with
    MINISGL_DISABLE_FUSED_OPS=1. On CPU the interpreted kernels are forced in, which checks the
    layers' wiring (in-place residual, qk-norm rows, rotary with the KV store, which replaces
    the backend's store_kv)."""
    from minisgl import LLM, SamplingParams
    from minisgl.kvcache.pool import MHAKVCache

    path, _ = model_dirs(arch)
    prompts = [[5, 17, 300, 42, 7], list(range(100, 123)), [9] * 11]

    def generate() -> list[list[int]]:
        llm = LLM(
            path,
            device="cuda:0" if CUDA else "cpu",
            dtype="float32",
            page_size=4,
            num_pages=64,
            max_prefill_tokens=16,  # chunked prefill: extends over a cached prefix
        )
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=6), use_tqdm=False)
        finally:
            llm.shutdown()
        return [o["token_ids"] for o in outs]

    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    expected = generate()
    monkeypatch.delenv("MINISGL_DISABLE_FUSED_OPS")
    real, used = kernel.fused_ops, []

    def spy(x: torch.Tensor, module: str = "fused"):
        if module != "fused":  # the sampler's and others' kernels: as they would be chosen
            return real(x, module)
        chosen = real(x) if CUDA else ops
        used.append(chosen is not None)
        return chosen

    monkeypatch.setattr(kernel, "fused_ops", spy)
    stores = []  # the backends' separate KV store: the fused rotary kernel replaces it
    monkeypatch.setattr(MHAKVCache, "store", lambda *args: stores.append(args))
    assert generate() == expected
    assert used and all(used)
    assert not stores
