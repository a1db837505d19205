"""GPU fast paths against the plain ones: the triton attention backend against the torch
backend on random paged KV, and whole tiny models against transformers (greedy tokens)."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.attention import create_attention_backend
from minisgl.core import Batch, Context, Req, SamplingParams, set_global_ctx
from minisgl.kvcache import MHAKVCache
from models import hf_greedy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = torch.device("cuda")
HEADS, KV_HEADS = 8, 2
TOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2}


def make_batch(
    lens: list[tuple[int, int]], page_size: int, head_dim: int, dtype: torch.dtype, decode: bool
) -> tuple[Batch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A context whose pool holds random KV for every request's cached prefix, scattered over
    shuffled pages, and a batch of (cached_len, extend_len) requests with random q/k/v."""
    gen = torch.Generator().manual_seed(page_size * 1000 + head_dim + len(lens))
    rng = random.Random(len(lens) + page_size)
    max_len = max(c + e for c, e in lens)
    pages_per_req = -(-max_len // page_size)
    num_pages = len(lens) * pages_per_req + 3
    pool = MHAKVCache(1, num_pages, page_size, KV_HEADS, head_dim, dtype, DEVICE)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=gen))
    table = torch.zeros(len(lens) + 2, pages_per_req, dtype=torch.int32)
    free = list(range(num_pages))
    rng.shuffle(free)
    reqs, slots = [], []
    for i, (cached, extend) in enumerate(lens):
        row = len(lens) + 1 - i  # rows out of order too
        table[row] = torch.tensor(free[i * pages_per_req : (i + 1) * pages_per_req])
        req = Req([0] * (cached + extend), cached + extend, SamplingParams(), cached + extend + 1)
        req.table_idx, req.cached_len, req.extend_len = row, cached, extend
        reqs.append(req)
        pos = torch.arange(cached, cached + extend)
        slots.append(table[row, pos // page_size].long() * page_size + pos % page_size)
    backend = create_attention_backend("torch", DEVICE)
    set_global_ctx(Context(page_size, table.to(DEVICE), pool, backend))
    batch = Batch(reqs, "decode" if decode else "prefill", out_loc=torch.cat(slots).to(DEVICE))
    tokens = sum(e for _, e in lens)
    q = torch.randn(tokens, HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(tokens, KV_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(tokens, KV_HEADS, head_dim, generator=gen).to(DEVICE, dtype)
    return batch, q, k, v


def run_backend(name: str, batch: Batch, q, k, v) -> torch.Tensor:
    backend = create_attention_backend(name, DEVICE)
    backend.prepare(batch)
    return backend.forward(q, k, v, 0, q.shape[-1] ** -0.5, batch)


DECODE_LENS = [(0, 1), (5, 1), (16, 1), (17, 1), (300, 1), (1000, 1), (2049, 1)]
EXTEND_LENS = [(0, 1), (0, 37), (16, 16), (13, 70), (100, 5), (250, 129), (3, 1)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "extend"])
def test_triton_matches_torch_backend(decode, page_size, head_dim, dtype):
    lens = DECODE_LENS if decode else EXTEND_LENS
    batch, q, k, v = make_batch(lens, page_size, head_dim, dtype, decode)
    try:
        ref = run_backend("torch", batch, q, k, v)
        out = run_backend("triton", batch, q, k, v)
    finally:
        set_global_ctx(None)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    diff = (out.float() - ref.float()).abs().max().item()
    print(f"max abs diff {diff:.3g}")
    assert diff <= TOL[dtype], diff


def test_decode_single_long_request_uses_splits():
    batch, q, k, v = make_batch([(4000, 1)], 16, 128, torch.bfloat16, True)
    try:
        ref = run_backend("torch", batch, q, k, v)
        backend = create_attention_backend("triton", DEVICE)
        backend.prepare(batch)
        assert batch.attn_metadata.num_splits > 1
        out = backend.forward(q, k, v, 0, 128**-0.5, batch)
    finally:
        set_global_ctx(None)
    assert (out.float() - ref.float()).abs().max().item() <= TOL[torch.bfloat16]


def test_auto_picks_triton_on_cuda_without_window():
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.attention.triton_backend import TritonAttnBackend

    cuda = torch.device("cuda")
    assert isinstance(create_attention_backend("auto", cuda), TritonAttnBackend)
    assert isinstance(create_attention_backend("auto", cuda, 4096), TorchAttnBackend)
    with pytest.raises(ValueError, match="sliding"):
        create_attention_backend("triton", cuda, 4096)


MODEL_ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]
MAX_NEW = 12


def prompts() -> list[list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(384) for _ in range(20)]
    out = [[rng.randrange(384) for _ in range(n)] for n in (3, 17, 41)]
    return out + [shared + [rng.randrange(384) for _ in range(n)] for n in (2, 11)]


@pytest.fixture(scope="module")
def references(model_dirs):
    cache = {}

    def get(arch):
        if arch not in cache:
            path, hf = model_dirs(arch)
            cache[arch] = (path, [hf_greedy(hf, p, MAX_NEW) for p in prompts()])
        return cache[arch]

    return get


@pytest.mark.parametrize("attn", ["torch", "triton"])
@pytest.mark.parametrize("arch", MODEL_ARCHS)
def test_greedy_equals_transformers_on_gpu(references, arch, attn):
    from minisgl import LLM

    path, expected = references(arch)
    llm = LLM(
        path,
        device="cuda:0",  # Engine.set_device needs an index (torch 2.11)
        dtype="float32",
        attn=attn,
        page_size=16,
        num_pages=64,
        max_prefill_tokens=8,
    )
    try:
        outputs = llm.generate(prompts(), SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    finally:
        llm.shutdown()
    got = [o["token_ids"] for o in outputs]
    mismatched = [i for i, (g, e) in enumerate(zip(got, expected)) if g != e]
    print(f"{arch}/{attn}: {len(mismatched)} of {len(expected)} prompts differ")
    assert not mismatched, [(got[i], expected[i]) for i in mismatched]
