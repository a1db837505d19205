"""Greedy tokens and logits of minisgl equal transformers', CPU float32, every architecture,
under paging, chunked prefill, prefix sharing and preemption."""

import random

import pytest
import torch
from torch import nn

from minisgl import LLM, SamplingParams
from minisgl.core import Batch
from minisgl.layers.base import Module
from support.invariants import check_no_leak
from support.models import ARCHS, hf_greedy

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
        assert sched.planner.num_preemptions > 0, "the small pool was meant to force preemption"
    assert not sched.planner.busy
    check_no_leak(sched)
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
    check_no_leak(llm.scheduler)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(model_dirs, arch):
    path, hf = model_dirs(arch)
    llm = LLM(path, page_size=4, num_pages=256)
    sched, engine = llm.scheduler, llm.engine
    prompts = make_prompts()[:6]
    reqs = [sched.make_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    for req in reqs:  # admit by hand to run one prefill forward of the whole batch
        sched.planner.admit(req)
        assert sched.planner.grow(req, req.remaining_len)
        req.extend_len = req.remaining_len
    logits = engine.forward(Batch(reqs, "prefill")).logits.float()
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
        assert sched.planner.grow(req, 1)
    logits = engine.forward(Batch(reqs, "decode")).logits.float()
    with torch.no_grad():
        for i, req in enumerate(reqs):
            ref = hf(torch.tensor([req.tokens])).logits[0, -1]
            torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
    for req in reqs:
        req.cached_len = len(req.tokens)
        sched.planner.release(req)
    check_no_leak(sched)


def test_sharded_checkpoint_loads(tmp_path):
    from support.models import save_model

    hf = save_model("llama", str(tmp_path), max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    llm = LLM(str(tmp_path), page_size=16, num_pages=64)
    prompts = make_prompts()[:3]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8), use_tqdm=False)
    assert [o["token_ids"] for o in outputs] == [hf_greedy(hf, p, 8) for p in prompts]


@pytest.mark.parametrize("overlap", [True, False])
def test_running_request_shares_its_prompt(references, monkeypatch, overlap):
    """A prompt's KV enters the prefix cache once it is prefilled, not when its request ends:
    a second request with the same prompt, admitted one step later while the first still
    decodes, computes only its last token and reads the first one's pages."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
    path, expected = references("qwen3")
    prompt = make_prompts()[8]  # 49 tokens: 12 full pages of 4
    llm = LLM(path, page_size=4, num_pages=256, max_prefill_tokens=len(prompt))
    sched = llm.scheduler
    a, b = (sched.make_request(prompt, SamplingParams(max_tokens=MAX_NEW)) for _ in range(2))
    sched.add_request(a)
    sched.add_request(b)
    sched.step()  # the budget holds a's whole prompt, not b's
    assert sched.planner.running == [a] and sched.planner.num_cached_tokens == 0
    sched.step()
    assert sched.planner.running == [a, b] and not a.finished
    assert sched.planner.num_cached_tokens == 48 and b.pages[:12] == a.pages[:12]
    check_no_leak(sched)
    while sched.has_work:
        sched.step()
    assert a.output_ids == b.output_ids == expected[8]
    check_no_leak(sched)


def test_shared_prefix_found_across_chunks(references):
    """Requests sharing a 20-token prefix, chunked 8 tokens a step: each later one finds the
    part the earlier ones have launched, while they still run; outputs are unchanged."""
    path, expected = references("qwen3")
    prompts = make_prompts()[5:10]
    outs = {}
    for cache in ("radix", "naive"):
        llm = LLM(path, page_size=4, num_pages=256, cache=cache, max_prefill_tokens=8)
        outs[cache] = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
        assert [o["token_ids"] for o in outs[cache]] == expected[5:10]
        check_no_leak(llm.scheduler)
        # p6 is admitted beside p5's last chunk and finds p5's first 2 chunks (16 tokens); p7,
        # p8 find the whole shared 20; p9 (the shared part alone) its 4 full pages but the last.
        cached = llm.scheduler.planner.num_cached_tokens
        assert cached == (16 + 20 + 20 + 16 if cache == "radix" else 0)


def test_same_batch_duplicate_pages_go_back(references):
    """Two equal prompts prefilled in one batch both compute the prompt; the second one's
    copies go back to the pool at once and its page-table row points at the first one's
    pages, so the next prompt, which reuses those freed pages, cannot corrupt its decode."""
    path, expected = references("qwen3")
    p, q = make_prompts()[8], make_prompts()[4]  # q shares nothing with p
    llm = LLM(path, page_size=4, num_pages=256, max_prefill_tokens=2 * len(p))
    sched = llm.scheduler
    reqs = [sched.make_request(x, SamplingParams(max_tokens=MAX_NEW)) for x in (p, p, q)]
    for req in reqs:
        sched.add_request(req)
    sched.step()
    a, b, c = reqs
    assert sched.planner.running == [a, b] and b.pages[:12] == a.pages[:12]
    freed = sched.cache.allocator._free[-12:]
    sched.step()
    assert set(freed) <= set(c.pages), "the freed copies were meant to be reused at once"
    while sched.has_work:
        sched.step()
    assert [r.output_ids for r in reqs] == [expected[8], expected[8], expected[4]]
    check_no_leak(sched)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_layer_calls_its_forward_directly(model_dirs, arch):
    """Each layer derives from minisgl's Module, whose call skips nn.Module's hook dispatch
    (4-5 % of a CPU decode step): a layer added on plain nn.Module would pay it again."""
    llm = LLM(model_dirs(arch)[0], page_size=4, num_pages=16)
    model = llm.engine.model
    slow = [type(m).__name__ for m in model.modules() if not isinstance(m, (Module, nn.ModuleList))]
    assert not slow, f"layers on plain nn.Module: {sorted(set(slow))}"
    assert type(model).__call__ is Module.__call__
