"""Speculative decoding (n-gram prompt lookup): outputs token for token those of plain decoding,
greedy and seeded sampling, under paging, prefix caching, chunked prefill, mixed steps,
preemption, stop tokens and length limits inside accepted runs; proposals are accepted."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.core import Req
from minisgl.ext.spec.options import SpecOptions
from minisgl.ext.spec.proposers import NgramProposer, latest_match, room
from minisgl.ext.spec.speculator import Backoff, SpecState, accept
from minisgl.scheduler.config import SchedulerConfig
from minisgl.utils.options import OptionError
from support.invariants import check_no_leak


def workload(n: int = 10, temperature: float = 0.0) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(0)
    # repetitive prompts: the lookup finds continuations (a random model also loops often)
    prompts = []
    for _ in range(n):
        motif = [rng.randrange(2, 300) for _ in range(rng.randint(2, 6))]
        prompts.append((motif * 8)[: rng.randint(3, 40)] + [rng.randrange(2, 300)])
    params = [
        SamplingParams(
            max_tokens=rng.randint(1, 40),
            temperature=temperature * (i % 2),
            top_p=0.9 if i % 3 == 1 else 1.0,
            seed=i,
            stop_token_ids=[rng.randrange(2, 300) for _ in range(20)],  # some stop early
        )
        for i in range(n)
    ]
    return prompts, params


def generate(
    path: str, monkeypatch, overlap: bool = True, temperature: float = 0.0, graphs: int = 0, **kw
):
    """graphs: replay decode batches of up to this many rows through the CUDA-graph step, run
    eagerly (GraphRunner without capture), in the target and in a draft model's engine."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
    llm = LLM(path, **kw)
    if graphs:
        use_graph_step(llm, graphs)
    try:
        outs = llm.generate(*workload(temperature=temperature), use_tqdm=False)
        while llm.scheduler.has_work:  # a step launched for requests that ended meanwhile
            assert llm.scheduler.step() == []
        check_no_leak(llm.scheduler)
        return outs
    finally:
        llm.shutdown()


def use_graph_step(llm: LLM, max_bs: int) -> None:
    from minisgl.engine.graph import GraphRunner
    from minisgl.ext.spec.proposers import DraftModelProposer, using_context

    llm.engine.graphs = GraphRunner(llm.engine, max_bs, capture=False)
    assert llm.scheduler.spec is not None
    proposer = llm.scheduler.spec.proposer
    if isinstance(proposer, DraftModelProposer):
        with using_context(proposer.engine.ctx):
            proposer.engine.graphs = GraphRunner(proposer.engine, max_bs, capture=False)


CONFIGS = [  # page size, pages, prefix cache, prompt tokens per step
    dict(page_size=1, num_pages=2048, cache="radix", max_prefill_tokens=16),
    dict(page_size=16, num_pages=128, cache="radix", max_prefill_tokens=8192),
    dict(page_size=16, num_pages=128, cache="naive", max_prefill_tokens=24),
    dict(page_size=4, num_pages=24, cache="radix", max_prefill_tokens=24),  # preemption
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"p{c['page_size']}-{c['cache']}")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("overlap, backoff", [(True, 16), (False, 0)], ids=["adaptive", "every"])
def test_ngram_outputs_equal_plain_decoding(
    model_dirs, monkeypatch, config, temperature, overlap, backoff
):
    """Adaptive (the default: requests back off, the steps between proposals overlap) and
    proposing at every step without overlap."""
    path, _ = model_dirs("qwen3")
    plain = generate(path, monkeypatch, temperature=temperature, **config)
    spec = generate(
        path, monkeypatch, overlap=overlap, temperature=temperature,
        speculative_algorithm="ngram", speculative_num_draft_tokens=3,
        speculative_max_backoff=backoff, **config,
    )  # fmt: skip
    assert [(o["token_ids"], o["finish_reason"]) for o in spec] == [
        (o["token_ids"], o["finish_reason"]) for o in plain
    ]
    assert any(o["finish_reason"] == "stop" for o in plain)
    assert sum(o["num_accepted_tokens"] for o in spec) > 0
    assert all(o["num_accepted_tokens"] <= o["num_draft_tokens"] for o in spec)


def test_sampled_tokens_with_and_without_speculation_share_a_distribution(model_dirs, monkeypatch):
    """Seeded sampling is the same draw with or without speculation; across seeds the tokens
    after a repetitive prompt (where proposals are verified) have the same histogram."""
    path, _ = model_dirs("qwen3")
    prompt = [5, 6, 7] * 6
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s) for s in range(60)]

    def tokens(**kw) -> list[list[int]]:
        llm = LLM(path, page_size=4, **kw)
        try:
            return [o["token_ids"] for o in llm.generate([prompt] * 60, params, use_tqdm=False)]
        finally:
            llm.shutdown()

    plain, spec = tokens(), tokens(speculative_algorithm="ngram")
    assert spec == plain
    for position in range(1, 6):
        counts_plain, counts_spec = ({}, {})
        for out, counts in ((plain, counts_plain), (spec, counts_spec)):
            for ids in out:
                counts[ids[position]] = counts.get(ids[position], 0) + 1
        chi2 = sum((counts_spec.get(t, 0) - n) ** 2 / n for t, n in counts_plain.items())
        assert chi2 == 0.0


class WrongProposer(NgramProposer):
    """Proposes ids the scripted model never outputs: nothing is ever accepted."""

    def propose(self, req: Req) -> list[int]:
        return [1] * room(req, self.num_draft)


def test_backoff_doubles_to_its_cap_and_resets_on_a_gain() -> None:
    """Nothing gained: every 2nd step, then every 4th (the cap), on the shared clock; a gain at
    step 8 makes it propose at the next step again."""
    backoff = Backoff(max_steps=4)
    req = Req([5, 6, 7], 3, SamplingParams(max_tokens=50), max_total_len=60)
    state, due = SpecState(), []
    for step in range(12):
        if backoff.due(req, state, 3):
            due.append(step)
            backoff.result(state, gained=step == 8)
        backoff.tick()
    assert due == [0, 2, 4, 8, 9, 10]  # after the gain: step 9, which gains nothing, then 10
    plain = Req([5], 1, SamplingParams(max_tokens=50, presence_penalty=0.5), max_total_len=60)
    assert not backoff.due(plain, SpecState(), 3)  # penalties: it never proposes
    for cap in (0, 1):  # proposing at every step
        every, state = Backoff(max_steps=cap), SpecState()
        for _ in range(3):
            assert every.due(req, state, 3)
            every.result(state, gained=False)
            every.tick()


@pytest.mark.parametrize("backoff", [0, 4])
def test_proposals_that_never_pay_back_off_and_the_steps_between_overlap(
    model_dirs, monkeypatch, backoff
):
    """Nothing accepted: with a cap of 4 the request verifies in decode steps 0, 2, 4, 8, 12,
    ... and every step between runs overlapped; with 0 it verifies at every step, none
    overlapped. The tokens are plain decoding's either way."""
    path, _ = model_dirs("qwen3")
    prompt, params = [[7, 8, 9, 10]], SamplingParams(max_tokens=24, ignore_eos=True)
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0")
    llm = LLM(path, page_size=4, num_pages=64)
    try:
        expected = llm.generate(prompt, params, use_tqdm=False)[0]["token_ids"]
    finally:
        llm.shutdown()
    llm = LLM(path, page_size=4, num_pages=64, speculative_algorithm="ngram",
              speculative_num_draft_tokens=3, speculative_max_backoff=backoff)  # fmt: skip
    scheduler = llm.scheduler
    assert scheduler.spec is not None
    scheduler.spec.proposer = WrongProposer(3, 1, 1)
    verifying, overlapped = [], []
    real_process = scheduler._process

    def process(step):
        verifying.append(step.verifies)
        return real_process(step)

    monkeypatch.setattr(scheduler, "_process", process)
    real_step = scheduler.step

    def step():
        outputs = real_step()
        overlapped.append(scheduler.in_flight is not None)
        return outputs

    monkeypatch.setattr(scheduler, "step", step)
    try:
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        check_no_leak(scheduler)
    finally:
        llm.shutdown()
    assert out["token_ids"] == expected
    assert out["num_accepted_tokens"] == 0
    decodes = verifying[1:]  # after the prefill's
    if backoff == 0:
        assert all(decodes[:-1]) and not any(overlapped[1:-2])
    else:
        assert [i for i, v in enumerate(decodes) if v][:5] == [0, 2, 4, 8, 12]
        assert sum(overlapped) >= len(decodes) - 2 * sum(decodes)


def test_ngram_proposer_takes_the_latest_longest_match() -> None:
    proposer = NgramProposer(num_draft=3, min_n=1, max_n=3)

    def req(tokens: list[int], max_tokens: int = 100) -> Req:
        return Req(list(tokens), 2, SamplingParams(max_tokens=max_tokens), max_total_len=1000)

    # "1 2 3" occurs twice: the latest occurrence's continuation wins
    assert proposer.propose(req([1, 2, 3, 9, 9, 1, 2, 3, 7, 7, 5, 1, 2, 3])) == [7, 7, 5]
    assert proposer.propose(req([4, 8, 1, 2, 5, 6, 2])) == [5, 6, 2]  # 1-gram "2"
    assert proposer.propose(req([1, 2, 3, 4])) == []  # no earlier match
    # 3 tokens out of 5: one more proposal, then the step's own token ends the request
    assert proposer.propose(req([1, 2, 1, 2, 1], max_tokens=5)) == [2]
    biased = Req([1, 2, 1, 2], 2, SamplingParams(logit_bias={3: 1.0}), max_total_len=1000)
    assert proposer.propose(biased) == []  # adjusted logits decode without proposals
    assert latest_match("".join(map(chr, [1, 2, 1, 2])), 2) == 2


def reference_lookup(tokens: list[int], n: int) -> int | None:
    """latest_match as a loop over the window (what it replaced)."""
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start : start + n] == tokens[-n:]:
            return start + n
    return None


def test_ngram_lookup_equals_the_reference_loop() -> None:
    """The string search against the loop on random token lists (few and many distinct ids,
    ids past 0xFFFF and in the surrogate range), within the window, and as a request grows
    (the kept string is extended) or is replaced by other tokens under the same uid."""
    rng = random.Random(0)
    for _ in range(2000):
        vocab = rng.choice([2, 3, 7, 300, 0xD900, 150_000])
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(2, 50))]
        text = "".join(map(chr, tokens))
        for n in range(1, min(5, len(tokens))):
            assert latest_match(text, n) == reference_lookup(tokens, n), (tokens, n)
    proposer = NgramProposer(num_draft=4, min_n=1, max_n=4)
    req = Req([5, 6, 7, 8, 5, 6], 2, SamplingParams(max_tokens=20000), max_total_len=30000)
    for _ in range(300):  # past the 4,096-token window
        window = req.tokens[-4096:]
        expected: list[int] = []
        for n in range(min(4, len(window) - 1), 0, -1):
            if (end := reference_lookup(window, n)) is not None:
                expected = window[end : end + 4]
                break
        assert proposer.propose(req) == expected
        req.tokens += [rng.randrange(20) for _ in range(rng.choice([1, 1, 3, 60]))]
    req.tokens[:] = [3, 9, 1, 4, 9, 1]  # other tokens under the same uid, fewer: rebuilt
    assert proposer.propose(req) == [4, 9, 1]
    req.tokens[:] = [3, 8, 1, 4, 8, 1, 2]  # as many as kept, and more, its last one differs
    assert proposer.propose(req) == []
    req.tokens[-1] = 8
    assert proposer.propose(req) == [1, 8]  # "8" last seen at 4
    proposer.release(req)
    assert req.uid not in proposer.texts
    assert accept([4, 5, 6], [4, 5, 9, 1]) == [4, 5, 9]
    assert accept([4, 5], [4, 5, 8]) == [4, 5, 8]
    assert accept([4], [3, 0]) == [3]


def test_bad_speculative_options_name_the_flag() -> None:
    with pytest.raises(OptionError, match="speculative_algorithm"):
        SpecOptions(speculative_algorithm="eagle")  # type: ignore[arg-type]
    with pytest.raises(OptionError, match="num_draft_tokens"):
        SchedulerConfig.from_options(
            {"speculative_algorithm": "ngram", "speculative_num_draft_tokens": 0}
        )
    with pytest.raises(OptionError, match="must not exceed") as error:
        SpecOptions(
            speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=2
        )
    assert error.value.name == "speculative_ngram_min_match_window_size"


def test_standalone_draft_outputs_equal_plain_decoding(model_dirs, monkeypatch):
    """A different small model (same vocabulary) drafts: the output is still plain decoding's;
    the target drafting for itself has every proposal accepted."""
    path, _ = model_dirs("qwen3")
    draft, _ = model_dirs("llama")
    config = dict(page_size=4, num_pages=96, max_prefill_tokens=24)
    for temperature in (0.0, 0.8):
        plain = generate(path, monkeypatch, temperature=temperature, **config)
        for drafter in (draft, path):
            spec = generate(
                path, monkeypatch, temperature=temperature, speculative_algorithm="standalone",
                speculative_draft_model_path=drafter, speculative_num_draft_tokens=3, **config,
            )  # fmt: skip
            assert [o["token_ids"] for o in spec] == [o["token_ids"] for o in plain]
            drafted = sum(o["num_draft_tokens"] for o in spec)
            accepted = sum(o["num_accepted_tokens"] for o in spec)
            assert drafted > 0
            if drafter == path:  # the same model samples the same tokens
                assert accepted == drafted


def test_standalone_refuses_a_draft_with_another_vocabulary(model_dirs, tmp_path) -> None:
    import transformers as tf

    from support.models import COMMON

    path, _ = model_dirs("qwen3")
    other = str(tmp_path / "other-vocab")
    tf.LlamaForCausalLM(tf.LlamaConfig(**{**COMMON, "vocab_size": 300})).save_pretrained(other)
    with pytest.raises(OptionError, match="vocabulary") as error:
        LLM(path, speculative_algorithm="standalone", speculative_draft_model_path=other)
    assert error.value.name == "speculative_draft_model_path"
    with pytest.raises(OptionError, match="required"):
        SpecOptions(speculative_algorithm="standalone")
    with pytest.raises(OptionError, match="only with it"):
        SpecOptions(speculative_draft_model_path=path)


def test_target_leaves_room_for_the_draft_pool(model_dirs) -> None:
    """On the GPU the target's pool is sized from a share of the free memory by KV bytes per
    token, so the draft's pool (sized after it) fits: half each for the target as its own
    draft (the target took all of it before, and the draft's pool ran out of memory)."""
    from minisgl.engine import EngineConfig
    from minisgl.ext.spec.proposers import kv_per_token, leave_room_for_draft

    def standalone(draft: str) -> SchedulerConfig:
        options = {"speculative_algorithm": "standalone", "speculative_draft_model_path": draft}
        return SchedulerConfig.from_options(options)

    path, _ = model_dirs("qwen3")
    draft, _ = model_dirs("llama")
    engine = EngineConfig(model=path, memory_ratio=0.9)
    itself = standalone(path)
    assert leave_room_for_draft(engine, itself).memory_ratio == pytest.approx(0.45)
    other = standalone(draft)
    share = kv_per_token(path) / (kv_per_token(path) + kv_per_token(draft))
    assert leave_room_for_draft(engine, other).memory_ratio == pytest.approx(0.9 * share)
    fixed = EngineConfig(model=path, num_pages=64)  # a fixed page count applies to both
    assert leave_room_for_draft(fixed, itself) == fixed
    assert leave_room_for_draft(engine, SchedulerConfig()) == engine


@pytest.mark.parametrize("algorithm", ["ngram", "standalone"])
def test_verify_as_decode_rows_equals_plain_decoding(model_dirs, monkeypatch, algorithm):
    """With CUDA graphs a verify step (and a draft's short catch-up) runs as one decode row per
    position (ext/spec/verify.flat_batch) through the graph step: plain decoding's tokens still,
    greedy and sampled (top-p too), with and without the graph step for the rows."""
    from minisgl.ext.spec import verify

    path, _ = model_dirs("qwen3")
    spec: dict = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    if algorithm == "standalone":
        spec["speculative_draft_model_path"] = path  # itself: every proposal accepted
    flattened = []
    real = verify.flat_batch
    monkeypatch.setattr(verify, "flat_batch", lambda b, m: flattened.append(r := real(b, m)) or r)
    config = dict(page_size=4, num_pages=256, max_prefill_tokens=24)
    for temperature in (0.0, 0.8):
        plain = generate(path, monkeypatch, temperature=temperature, **config)
        fast = generate(
            path, monkeypatch, overlap=False, temperature=temperature, graphs=16, **spec, **config
        )
        assert [o["token_ids"] for o in fast] == [o["token_ids"] for o in plain]
        assert sum(o["num_accepted_tokens"] for o in fast) > 0
    assert any(b is not None and b.size > 1 for b in flattened)
