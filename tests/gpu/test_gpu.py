"""GPU fast paths against the plain ones: whole tiny models against transformers (greedy
tokens). The attention backends alone are compared in test_attention_gpu.py."""

from __future__ import annotations

import random

import pytest

from minisgl.core import SamplingParams
from support.models import hf_greedy

pytestmark = pytest.mark.gpu

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
