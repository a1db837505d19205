"""minisgl's causal attention kernel for fresh prompts (ext/cpu/attention.cpp, called by
ext/cpu/speed.py): within float32 rounding of SDPA (both bounded against float64), grouped and
plain heads, ragged batches, a strided q, the same bits on any threads and in any batch, its
checks, and the backend's use of it (packed rows and slots) with SDPA kept where it does not fit."""

from __future__ import annotations

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


def sdpa(q, k, v, starts, scale):
    """Each prompt through torch's causal SDPA, [T, H, D] in and out."""
    outs = []
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        qs, ks, vs = (x[a:b].transpose(0, 1).unsqueeze(0) for x in (q, k, v))
        out = F.scaled_dot_product_attention(
            qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True
        )
        outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def problem(lens, q_heads, kv_heads, dim, seed=0):
    gen = torch.Generator().manual_seed(seed)
    tokens = sum(lens)
    q = torch.randn(tokens, q_heads, dim, generator=gen) * 2
    k = torch.randn(tokens, kv_heads, dim, generator=gen) * 2
    v = torch.randn(tokens, kv_heads, dim, generator=gen)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    return q, k, v, starts


@pytest.mark.parametrize(
    "lens, q_heads, kv_heads, dim",
    [
        ([300], 9, 3, 64),  # SmolLM2's heads; several key blocks, a partial last one
        ([37], 4, 4, 128),  # plain heads, a wider head
        ([5, 100, 1, 70], 8, 1, 64),  # ragged, a one-token prompt, eight q heads to a kv head
    ],
)
def test_within_float32_rounding_of_sdpa(lens, q_heads, kv_heads, dim):
    """Both against float64: the kernel's error at most twice SDPA's float32 error (+1e-6)."""
    q, k, v, starts = problem(lens, q_heads, kv_heads, dim)
    scale = dim**-0.5
    got = torch.ops.minisgl.causal_attention(q, k, v, starts, scale)
    exact = sdpa(q.double(), k.double(), v.double(), starts, scale)
    sdpa_error = (sdpa(q, k, v, starts, scale).double() - exact).abs().max().item()
    error = (got.double() - exact).abs().max().item()
    assert got.shape == q.shape and got.dtype == torch.float32
    assert error <= 2 * sdpa_error + 1e-6, (error, sdpa_error)


def test_same_bits_on_any_threads_in_any_batch_and_from_a_strided_q():
    """A work item is one thread's, in a fixed order: one thread or two, a prompt alone or in a
    batch, and q as a view of a wider QKV output give the same bits."""
    q, k, v, starts = problem([130, 64, 17], 6, 2, 64, seed=1)

    class Op(torch.nn.Module):
        def forward(self, x):
            return torch.ops.minisgl.causal_attention(x, k, v, starts, 0.125)

    one, two = on_one_thread_and_two(Op(), q)
    assert torch.equal(one, two)
    for a, b in zip(starts[:-1].tolist(), starts[1:].tolist()):
        alone = torch.ops.minisgl.causal_attention(
            q[a:b], k[a:b], v[a:b], torch.tensor([0, b - a]), 0.125
        )
        assert torch.equal(alone, one[a:b])
    qkv = torch.cat([q, torch.zeros(q.shape[0], 2, 64)], dim=1)  # positions 8 heads apart
    assert torch.equal(torch.ops.minisgl.causal_attention(qkv[:, :6], k, v, starts, 0.125), one)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda q, k, v, s: (q.double(), k, v, s), "float32"),
        (lambda q, k, v, s: (q[..., :32], k[..., :32], v[..., :32], s), "shapes"),
        (lambda q, k, v, s: (q, k, v, torch.tensor([0, 5])), "from 0 to T"),
        (lambda q, k, v, s: (q, k, v, s.int()), "int64"),
    ],
)
def test_refuses_what_it_cannot_compute(change, message):
    q, k, v, starts = problem([8], 4, 2, 64)
    with pytest.raises(RuntimeError, match=message):
        torch.ops.minisgl.causal_attention(*change(q, k, v, starts), 0.125)


@pytest.mark.ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backend_attends_fresh_prompts_with_it(dtype, monkeypatch):
    """ext/cpu's backend packs a fresh batch (starts, each row's own slot) for the kernel: within
    float32 rounding of the core's masked path; a 16-dim head keeps SDPA (bit for bit there)."""
    from minisgl.ext.cpu.speed import CausalMetadata, WideTorchAttnBackend

    calls = []
    op = torch.ops.minisgl.causal_attention
    monkeypatch.setattr(speed_ops(), "causal_attention", lambda *a: calls.append(1) or op(*a))
    for dim in (64, 16):
        batch, q, _, _ = make_problem(
            [(0, 70), (0, 3), (0, 33)], 4, dim, dtype, False, torch.device("cpu")
        )
        wide = WideTorchAttnBackend()
        wide.prepare(batch)
        md = batch.attn_metadata
        assert isinstance(md, CausalMetadata) and md.starts.tolist() == [0, 70, 73, 106]
        assert torch.equal(md.slots, batch.out_loc)  # a fresh prompt's keys are its own rows
        got = wide.forward(q, 0, 0.25, batch)
        plain = TorchAttnBackend()
        plain.prepare(batch)
        want = plain.forward(q.float(), 0, 0.25, batch)
        if dim == 16:
            assert torch.equal(got, want.to(dtype))
        else:
            torch.testing.assert_close(
                got.float(), want, rtol=0, atol=2e-5 if dtype == torch.float32 else 0.02
            )
    assert len(calls) == 1  # the 64-dim heads only


def speed_ops():
    """The namespace speed.py reaches the op through (torch.ops.minisgl)."""
    return torch.ops.minisgl
