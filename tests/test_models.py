"""Greedy tokens and logits of minisgl equal transformers', CPU float32, every architecture,
under paging, chunked prefill, prefix sharing and preemption."""

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from models import ARCHS, hf_greedy

MAX_NEW = 16


def make_prompts(vocab: int = 384) -> list[list[int]]:
    rng = random.Random(1)
    shared = [rng.randrange(vocab) for _ in range(20)]
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 17, 33, 50)]
    prompts += [shared + [rng.randrange(vocab) for _ in range(n)] for n in (1, 6, 13, 29)]
    prompts.append(list(shared))  # fully contained in the others' prefix
    return prompts


@pytest.fixture(scope="module")
def references(model_dirs):
    cache = {}

    def get(arch):
        if arch not in cache:
            path, hf = model_dirs(arch)
            cache[arch] = (path, [hf_greedy(hf, p, MAX_NEW) for p in make_prompts()])
        return cache[arch]

    return get


# (page_size, num_pages, cache): the small pools force preemption (10 prompts need ~380 tokens)
CONFIGS = [(1, 160, "radix"), (16, 10, "radix"), (16, 64, "naive")]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size,num_pages,cache", CONFIGS)
def test_greedy_equals_transformers(references, arch, page_size, num_pages, cache):
    path, expected = references(arch)
    llm = LLM(path, page_size=page_size, num_pages=num_pages, cache=cache, max_prefill_tokens=8)
    prompts = make_prompts()
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, expected)):
        assert out["token_ids"] == ref, f"prompt {i} (len {len(prompts[i])})"
        assert out["finish_reason"] == "length"
    sched = llm.scheduler
    if num_pages * page_size < 200:
        assert sched.num_preemptions > 0, "the small pool was meant to force preemption"
    assert not sched.running and sched.prefilling is None and not sched.waiting
    sched.check_no_leak()
    assert (
        sched.cache.allocator.num_free + sched.cache.prefix_cache.num_pages == llm.engine.num_pages
    )
    assert sched.cache.prefix_cache.locked_pages == 0


def test_radix_cache_reuses_shared_prefix(references):
    path, expected = references("qwen3")
    llm = LLM(path, page_size=4, num_pages=512)
    prompts = make_prompts()
    first = llm.generate(prompts[5:6], SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    assert first[0]["token_ids"] == expected[5]
    # the second request shares 20 prompt tokens with the first: 5 pages come from the cache
    handle, pages = llm.scheduler.cache.prefix_cache.match_prefix(prompts[6])
    assert handle.length == 20 and len(pages) == 5
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == expected
    llm.scheduler.check_no_leak()


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs, arch):
    path, hf = model_dirs(arch)
    llm = LLM(path, page_size=4, num_pages=256)
    sched, engine = llm.scheduler, llm.engine
    prompts = make_prompts()[:6]
    reqs = [sched.make_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    for req in reqs:  # admit by hand to run one prefill forward of the whole batch
        sched._admit(req)
        assert sched._grow(req, req.remaining_len)
        req.extend_len = req.remaining_len
    logits = engine.forward(Batch(reqs, "prefill"))
    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
    # one decode step on top of the cached prompts
    next_ids = logits.argmax(-1).tolist()
    for req, tok in zip(reqs, next_ids):
        req.cached_len, req.extend_len = len(req.tokens), 1
        req.tokens.append(tok)
        engine.set_tokens(req.table_idx, req.tokens)
        assert sched._grow(req, 1)
    logits = engine.forward(Batch(reqs, "decode"))
    with torch.no_grad():
        for i, req in enumerate(reqs):
            ref = hf(torch.tensor([req.tokens])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
    for req in reqs:
        req.cached_len = len(req.tokens)
        sched._release(req)
    sched.check_no_leak()


def test_sharded_checkpoint_loads(tmp_path):
    from models import save_model

    hf = save_model("llama", str(tmp_path), max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), page_size=16, num_pages=64)
    prompts = make_prompts()[:3]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]
