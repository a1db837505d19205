"""minisgl's float32 CPU kernels. The causal attention for fresh prompts (attention.cpp, called
by ext/cpu/speed.py): within float32 rounding of SDPA (both bounded against float64), grouped
and plain heads, ragged batches, a strided q, the same bits on any threads and in any batch, its
checks, and the backend's use of it with SDPA kept where it does not fit. The fused RoPE,
SiLU-and-mul and RMSNorm (fused.cpp, called by speed.py and fused.py): RoPE bit for bit torch's,
the others within float32 rounding, and the modules a float32 engine installs."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.test_quantized import on_one_thread_and_two
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.ext.cpu import native
from support.attn import make_problem

pytestmark = pytest.mark.skipif(
    native.native_kernel() is None, reason="needs AVX512-VNNI and a C++ compiler"
)


def reference(q, k, v, q_starts, k_starts, scale):
    """Each prompt through torch's SDPA, its new tokens [T, H, D] against its keys, a token
    seeing the cached prefix and the new tokens up to itself (the explicit mask)."""
    outs = []
    for b in range(len(q_starts) - 1):
        qa, qb, ka, kb = (
            int(x) for x in (q_starts[b], q_starts[b + 1], k_starts[b], k_starts[b + 1])
        )
        allowed = torch.ones(qb - qa, kb - ka, dtype=torch.bool).tril(kb - ka - (qb - qa))
        qs = q[qa:qb].transpose(0, 1).unsqueeze(0)
        ks, vs = (x[ka:kb].transpose(0, 1).unsqueeze(0) for x in (k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, attn_mask=allowed, scale=scale, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def problem(lens, q_heads, kv_heads, dim, seed=0):
    """lens: (cached prefix, new tokens) per prompt -> q, k, v, q_starts, k_starts."""
    gen = torch.Generator().manual_seed(seed)
    tokens, keys = sum(n for _, n in lens), sum(p + n for p, n in lens)
    q = torch.randn(tokens, q_heads, dim, generator=gen) * 2
    k = torch.randn(keys, kv_heads, dim, generator=gen) * 2
    v = torch.randn(keys, kv_heads, dim, generator=gen)
    q_starts = torch.tensor([0, *itertools.accumulate(n for _, n in lens)])
    k_starts = torch.tensor([0, *itertools.accumulate(p + n for p, n in lens)])
    return q, k, v, q_starts, k_starts


@pytest.mark.parametrize(
    "lens, q_heads, kv_heads, dim",
    [
        ([(0, 300)], 9, 3, 64),  # SmolLM2's heads; several key blocks, a partial last one
        ([(0, 37)], 4, 4, 128),  # plain heads, a wider head
        ([(0, 5), (0, 100), (0, 1), (0, 70)], 8, 1, 64),  # ragged, eight q heads to a kv head
        ([(90, 40), (0, 20), (7, 1), (64, 64)], 6, 2, 64),  # cached prefixes
    ],
)
def test_within_float32_rounding_of_sdpa(lens, q_heads, kv_heads, dim):
    """Both against float64: the kernel's error at most twice SDPA's float32 error (+1e-6)."""
    q, k, v, q_starts, k_starts = problem(lens, q_heads, kv_heads, dim)
    scale = dim**-0.5
    got = torch.ops.minisgl.causal_attention(q, k, v, q_starts, k_starts, scale)
    exact = reference(q.double(), k.double(), v.double(), q_starts, k_starts, scale)
    sdpa_error = (reference(q, k, v, q_starts, k_starts, scale).double() - exact).abs().max()
    error = (got.double() - exact).abs().max().item()
    assert got.shape == q.shape and got.dtype == torch.float32
    assert error <= 2 * sdpa_error.item() + 1e-6, (error, sdpa_error)


def test_same_bits_on_any_threads_in_any_batch_and_from_a_strided_q():
    """A work item is one thread's, in a fixed order: one thread or two, a prompt alone or in a
    batch, and q as a view of a wider QKV output give the same bits."""
    q, k, v, q_starts, k_starts = problem([(0, 130), (30, 64), (0, 17)], 6, 2, 64, seed=1)

    class Op(torch.nn.Module):
        def forward(self, x):
            return torch.ops.minisgl.causal_attention(x, k, v, q_starts, k_starts, 0.125)

    one, two = on_one_thread_and_two(Op(), q)
    assert torch.equal(one, two)
    for b in range(3):
        qa, qb, ka, kb = (
            int(x) for x in (q_starts[b], q_starts[b + 1], k_starts[b], k_starts[b + 1])
        )
        starts = (torch.tensor([0, qb - qa]), torch.tensor([0, kb - ka]))
        alone = torch.ops.minisgl.causal_attention(q[qa:qb], k[ka:kb], v[ka:kb], *starts, 0.125)
        assert torch.equal(alone, one[qa:qb])
    qkv = torch.cat([q, torch.zeros(q.shape[0], 2, 64)], dim=1)  # positions 8 heads apart
    strided = torch.ops.minisgl.causal_attention(qkv[:, :6], k, v, q_starts, k_starts, 0.125)
    assert torch.equal(strided, one)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, qs, ks: (q.double(), k, v, qs, ks), "float32"),
        (lambda q, k, v, qs, ks: (q[..., :32], k[..., :32], v[..., :32], qs, ks), "shapes"),
        (lambda q, k, v, qs, ks: (q, k, v, torch.tensor([0, 5]), ks), "from 0 to T"),
        (lambda q, k, v, qs, ks: (q, k, v, qs, qs.int()), "int64"),
        (lambda q, k, v, qs, ks: (q, k[:4], v[:4], qs, torch.tensor([0, 4])), "fewer keys"),
    ],
)
def test_refuses_what_it_cannot_compute(change, message):
    q, k, v, q_starts, k_starts = problem([(0, 8)], 4, 2, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.minisgl.causal_attention(*change(q, k, v, q_starts, k_starts), 0.125)


@pytest.mark.ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens", [[(0, 70), (0, 3), (0, 33)], [(5, 70), (0, 3), (40, 33)]])
def test_backend_attends_prompts_with_it(dtype, lens, monkeypatch):
    """ext/cpu's backend packs a prompt batch (new tokens; keys: the cached prefix, then the
    new tokens') for the kernel: within float32 rounding of the core's masked path; a 16-dim
    head keeps SDPA's is_causal (fresh) or the mask (a prefix), bit for bit there."""
    from minisgl.ext.cpu.speed import PromptMetadata, WideTorchAttnBackend

    calls = []
    op = torch.ops.minisgl.causal_attention
    monkeypatch.setattr(speed_ops(), "causal_attention", lambda *a: calls.append(1) or op(*a))
    fresh = all(p == 0 for p, _ in lens)
    for dim in (64, 16):
        batch, q, _, _ = make_problem(lens, 4, dim, dtype, False, torch.device("cpu"))
        wide = WideTorchAttnBackend()
        wide.prepare(batch)
        md = batch.attn_metadata
        assert isinstance(md, PromptMetadata) and md.fresh == fresh
        assert md.q_starts.tolist() == [0, 70, 73, 106]
        assert md.k_starts.tolist() == [0, *itertools.accumulate(p + n for p, n in lens)]
        if fresh:
            assert torch.equal(md.k_slots, batch.out_loc)  # a fresh prompt's keys: its rows
        got = wide.forward(q, 0, 0.25, batch)
        plain = TorchAttnBackend()
        plain.prepare(batch)
        want = plain.forward(q.float(), 0, 0.25, batch)
        if dim == 16:
            assert torch.equal(got, want.to(dtype))
        else:
            atol = 2e-5 if dtype == torch.float32 else 0.02
            torch.testing.assert_close(got.float(), want, rtol=0, atol=atol)
    assert len(calls) == 1  # the 64-dim heads only


def speed_ops():
    """The namespace speed.py reaches the op through (torch.ops.minisgl)."""
    return torch.ops.minisgl


def error_against(got, exact):
    return (got.double() - exact).abs().max().item()


def test_rotation_is_torchs_bit_for_bit():
    """fused.cpp's RoPE on q and k as one strided view of the QKV output: speed.py's torch form."""
    from minisgl.ext.cpu.speed import rope_table

    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(40, (6 + 2 + 2) * 64, generator=gen)
    qk = qkv[:, : 8 * 64].unflatten(1, (8, 64))  # positions 640 floats apart
    table = rope_table(torch.randn(512, 64, generator=gen))
    rows = table[torch.randint(0, 512, (40,), generator=gen)]
    swapped = qk.view(40, 8, 2, 32).flip(-2).view(qk.shape)
    want = qk * rows[:, 0:1] + swapped * rows[:, 1:2]
    assert torch.equal(torch.ops.minisgl.rotate(qk, rows), want)


def test_silu_and_mul_within_float32_rounding():
    """Against float64: at most twice torch's error; saturating gates give silu's limits."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(33, 2 * 200, generator=gen) * 6
    x[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    wide = torch.cat([x, torch.zeros(33, 8)], dim=1)[:, :400]  # rows 408 floats apart
    gate, up = x.double().chunk(2, dim=-1)
    exact = F.silu(gate) * up
    ours = torch.ops.minisgl.silu_and_mul(wide)
    theirs = F.silu(x[:, :200]) * x[:, 200:]
    assert ours.shape == (33, 200) and torch.isfinite(ours).all()
    assert error_against(ours, exact) <= 2 * error_against(theirs, exact) + 1e-6


def test_rms_norm_within_float32_rounding_and_its_add_in_place():
    """RMSNorm against float64 within twice torch's error (rows of a [T, H, N] view too); with
    the residual, the residual is x + residual bit for bit and x receives the normed sum."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(96, generator=gen)
    x = torch.randn(17, 3, 2 * 96, generator=gen)[..., :96] * 4  # q-norm-like, not dense

    def exact_of(t):
        t = t.double()
        return weight.double() * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)

    theirs = weight * F.rms_norm(x, (96,), None, 1e-6)
    ours = torch.ops.minisgl.rms_norm(x, weight, 1e-6)
    assert ours.shape == x.shape
    assert error_against(ours, exact_of(x)) <= 2 * error_against(theirs, exact_of(x)) + 1e-6
    h, residual = torch.randn(9, 96, generator=gen), torch.randn(9, 96, generator=gen)
    summed = residual + h
    x_in, res_in = h.clone(), residual.clone()
    torch.ops.minisgl.add_rms_norm_(x_in, res_in, weight, 1e-6)
    assert torch.equal(res_in, summed)
    theirs = weight * F.rms_norm(summed, (96,), None, 1e-6)
    assert (
        error_against(x_in, exact_of(summed)) <= 2 * error_against(theirs, exact_of(summed)) + 1e-6
    )


def test_fused_rows_same_bits_on_any_threads():
    gen = torch.Generator().manual_seed(6)
    x, weight = torch.randn(64, 2 * 128, generator=gen), torch.randn(128, generator=gen)

    class Both(torch.nn.Module):
        def forward(self, t):
            return torch.ops.minisgl.rms_norm(torch.ops.minisgl.silu_and_mul(t), weight, 1e-5)

    one, two = on_one_thread_and_two(Both(), x)
    assert torch.equal(one, two)


@pytest.mark.ext
def test_float32_engines_install_the_fused_modules(model_dirs):
    """A float32 engine's RMSNorm and MLP modules are fused.py's (greedy tokens stay
    transformers'); a bfloat16 engine keeps the core's; compiling takes torch's path."""
    from minisgl import LLM, SamplingParams
    from minisgl.ext.cpu.fused import FusedMLP, FusedRMSNorm, fused_ready
    from minisgl.layers.norm import RMSNorm
    from minisgl.models.llama import MLP
    from support.models import hf_greedy

    path, hf = model_dirs("llama")
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for dtype, fused in (("float32", True), ("bfloat16", False)):
        llm = LLM(path, dtype=dtype, page_size=4, num_pages=64)
        modules = list(llm.engine.model.modules())
        norms = [m for m in modules if isinstance(m, RMSNorm)]
        mlps = [m for m in modules if isinstance(m, MLP)]
        assert norms and mlps
        assert all(isinstance(m, FusedRMSNorm) == fused for m in norms)
        assert all(isinstance(m, FusedMLP) == fused for m in mlps)
        if fused:
            out = llm.generate([[3, 1, 4, 1, 5]], params, use_tqdm=False)[0]["token_ids"]
            assert out == hf_greedy(hf, [3, 1, 4, 1, 5], 8)
            norm = norms[0]
            x = torch.randn(5, norm.weight.shape[0])
            compiled = torch.compile(norm.norm, fullgraph=True)  # the op has no fake: torch's
            torch.testing.assert_close(compiled(x), RMSNorm.norm(norm, x))
            probe = torch.compile(lambda t: t + 1 if fused_ready(t) else t - 1, fullgraph=True)
            assert torch.equal(probe(x), x - 1) and fused_ready(x)
        llm.shutdown()


@pytest.mark.ext
def test_fused_norm_updates_the_callers_residual_dense_or_not():
    """FusedRMSNorm's residual add lands in the caller's residual: in place when both are dense,
    through the core's path when the residual is a strided view (a copy would lose the sum)."""
    from minisgl.ext.cpu.fused import FusedRMSNorm
    from minisgl.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(7)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64, generator=gen)
    norm.__class__ = FusedRMSNorm
    for wide in (64, 80):  # 80: the residual is a view with rows 80 floats apart
        x = torch.randn(6, 64, generator=gen)
        residual = torch.randn(6, wide, generator=gen)[:, :64]
        summed = residual + x
        out, new_residual = norm(x.clone(), residual)
        assert new_residual is residual and torch.equal(residual, summed)
        want = norm.weight * F.rms_norm(summed, (64,), None, 1e-6)
        torch.testing.assert_close(out, want)


def decode_reference(q, k, v, slots, lens, scale):
    """Each decode row [Hq, D] against its first lens[b] slots of the pools, in float64."""
    outs = []
    for b in range(q.shape[0]):
        rows = slots[b, : int(lens[b])]
        ks, vs = (x[rows].double().transpose(0, 1) for x in (k, v))  # [Hk, n, D]
        group = q.shape[1] // k.shape[1]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        weights = (torch.einsum("hd,hnd->hn", q[b].double(), ks) * scale).softmax(-1)
        outs.append(torch.einsum("hn,hnd->hd", weights, vs))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    "rows, q_heads, kv_heads, dim, length",
    [(1, 16, 4, 64, 1900), (3, 8, 8, 128, 300), (2, 12, 4, 64, 1), (2, 4, 2, 256, 70)],
)
def test_decode_attention_reads_the_pools_in_place(dtype, rows, q_heads, kv_heads, dim, length):
    """Decode rows against their slots of 16-bit or float32 pools (scattered, never gathered):
    within float32 rounding of float64, the rows' own lengths (a prefix of their slots), the
    same bits on one thread and two and for a row alone."""
    gen = torch.Generator().manual_seed(dim + length)
    k, v = (torch.randn(4096, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(rows, q_heads, dim, generator=gen) * 2
    slots = torch.stack([torch.randperm(4096, generator=gen)[:length] for _ in range(rows)])
    lens = torch.tensor([max(1, length - 7 * b) for b in range(rows)])
    got = torch.ops.minisgl.decode_attention(q, k, v, slots, lens, 0.125)
    exact = decode_reference(q, k, v, slots, lens, 0.125)
    assert (got.double() - exact).abs().max().item() < 2e-6
    op = torch.ops.minisgl.decode_attention
    outs = on_one_thread_and_two(lambda x: op(x, k, v, slots, lens, 0.125), q)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], got)
    alone = op(q[-1:].contiguous(), k, v, slots[-1:], lens[-1:], 0.125)
    assert torch.equal(alone, got[-1:])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, s, n: (q.bfloat16(), k, v, s, n), "float32"),
        (lambda q, k, v, s, n: (q, k.float(), v, s, n), "share"),
        (lambda q, k, v, s, n: (q[..., :32].contiguous(), k[..., :32], v[..., :32], s, n), "64"),
        (lambda q, k, v, s, n: (q, k, v, s.int(), n), "int64"),
        (lambda q, k, v, s, n: (q, k, v, s, n + 10), "lens"),
        (lambda q, k, v, s, n: (q, k, v, s + 4096, n), "outside"),
    ],
)
def test_decode_attention_refuses_what_it_cannot_compute(change, message):
    k, v = (torch.randn(4096, 2, 64).bfloat16() for _ in range(2))
    q, slots, lens = torch.randn(2, 4, 64), torch.arange(10).view(2, 5), torch.tensor([5, 3])
    with pytest.raises(RuntimeError, match=message):
        torch.ops.minisgl.decode_attention(*change(q, k, v, slots, lens), 0.125)


@pytest.mark.ext
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_backend_decodes_16_bit_pools_with_it(dtype, monkeypatch):
    """ext/cpu's backend sends decode rows of a 16-bit pool to the kernel, each against its own
    length (a batch's mask: a prefix of its slots): within float32 rounding of the core's path,
    rounded to the dtype; a float32 pool keeps SDPA (the float32 paths' sums, bit for bit)."""
    from minisgl.ext.cpu.speed import WideTorchAttnBackend

    calls = []
    op = torch.ops.minisgl.decode_attention
    monkeypatch.setattr(speed_ops(), "decode_attention", lambda *a: calls.append(1) or op(*a))
    for lens in ([(300, 1)], [(40, 1), (299, 1), (3, 1)]):
        batch, q, _, _ = make_problem(lens, 4, 64, dtype, True, torch.device("cpu"))
        wide = WideTorchAttnBackend()
        wide.prepare(batch)
        got = wide.forward(q, 0, 0.25, batch)
        plain = TorchAttnBackend()
        plain.prepare(batch)
        want = plain.forward(q.float(), 0, 0.25, batch)
        if dtype == torch.float32:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=0.02, atol=0.02)
    assert len(calls) == (0 if dtype == torch.float32 else 2)
