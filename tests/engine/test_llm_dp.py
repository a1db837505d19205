"""`LLM(dp=2)` on CPU (issue 21): two replica processes give one engine's greedy outputs, in
order, chats and `n` included; prefix-aware dispatch keeps a prefix on one replica (the ablation:
round robin); a bad argument fails before any process starts; a dead replica fails the call
with its name and stops the rest."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from minisgl import LLM, SamplingParams
from support.server import make_tiny_model

PAGE = 4
OPTIONS = dict(device="cpu", page_size=PAGE, num_pages=400)
PREFIXES, PREFIX_LEN = 8, 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


@pytest.fixture(scope="module")
def dp_llm(model_dir: str) -> Iterator[LLM]:
    llm = LLM(model_dir, dp=2, **OPTIONS)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def one_llm(model_dir: str) -> Iterator[LLM]:
    llm = LLM(model_dir, **OPTIONS)
    yield llm
    llm.shutdown()


def test_dp2_equals_one_engine(dp_llm: LLM, one_llm: LLM) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 400) for _ in range(rng.randrange(3, 30))] for _ in range(12)]
    params = [SamplingParams(max_tokens=6 + i % 3, ignore_eos=True) for i in range(12)]
    params[5] = SamplingParams(max_tokens=5, ignore_eos=True, n=3, temperature=0.8, seed=7)
    expected = one_llm.generate(prompts, params, use_tqdm=False)
    assert dp_llm.generate(prompts, params, use_tqdm=False) == expected
    chats = [[{"role": "user", "content": f"hello number {i}"}] for i in range(4)]
    chat_params = SamplingParams(max_tokens=5, ignore_eos=True)
    assert dp_llm.chat(chats, chat_params, use_tqdm=False) == one_llm.chat(
        chats, chat_params, use_tqdm=False
    )
    assert dp_llm.generate("hi there", chat_params, use_tqdm=False) == one_llm.generate(
        "hi there", chat_params, use_tqdm=False
    )


def prefix_hits(llm: LLM) -> int:
    """Prompt tokens found cached when 8 prefixes, sent once each, come back in another order
    (round robin then sends each to the other replica)."""
    llm.reset_prefix_cache()
    rng = random.Random(1)
    prefixes = [[rng.randrange(3, 400) for _ in range(PREFIX_LEN)] for _ in range(PREFIXES)]
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    before = llm.num_cached_tokens
    for order in (range(PREFIXES), [(k + 1) % PREFIXES for k in range(PREFIXES)]):
        prompts = [prefixes[k] + [rng.randrange(3, 400) for _ in range(PAGE)] for k in order]
        llm.generate(prompts, params, use_tqdm=False)
    return llm.num_cached_tokens - before


def test_prefix_dispatch_beats_round_robin(dp_llm: LLM, model_dir: str) -> None:
    aware = prefix_hits(dp_llm)
    blind_llm = LLM(model_dir, dp=2, dp_dispatch="round_robin", **OPTIONS)
    try:
        blind = prefix_hits(blind_llm)
    finally:
        blind_llm.shutdown()
    assert aware >= PREFIXES * PREFIX_LEN and aware >= 1.8 * blind, (aware, blind)


def test_replica_errors_raise_as_themselves(dp_llm: LLM) -> None:
    with pytest.raises(ValueError, match="grammar|schema|JSON"):
        dp_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2, json_schema="{not json"))
    out = dp_llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out[0]["token_ids"]) == 2  # the pipes stay in step after an error


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(dp=0), "dp=0"),
        (dict(dp=2, dp_dispatch="random"), "dispatch policy 'random'"),
        (dict(dp=1, dp_dispatch="random"), "dispatch policy 'random'"),
        (dict(dp=2, dp_load_threshold=-1), "threshold must be >= 0"),
        (dict(dp=2, device="cuda:1"), "CUDA_VISIBLE_DEVICES"),
    ],
)
def test_bad_arguments_fail_before_start(model_dir: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(model_dir, **{**OPTIONS, **kwargs})


def test_dead_replica_fails_the_call_and_stops_the_rest(model_dir: str) -> None:
    llm = LLM(model_dir, dp=2, **OPTIONS)
    assert llm.replicas is not None
    procs = list(llm.replicas.procs)
    procs[1].kill()
    procs[1].join()
    prompts = [[3 + i, 4, 5] for i in range(4)]
    with pytest.raises(RuntimeError, match=r"dp replica 1 died \(exit code -9\)"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not any(p.is_alive() for p in procs)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, SamplingParams(max_tokens=2), use_tqdm=False)
    llm.shutdown()
