"""The offline LLM API: text and chat prompts, stop conditions, dummy weights."""

import shutil

import pytest
import torch

from minisgl import LLM, SamplingParams
from support.invariants import check_no_leak
from support.models import hf_greedy
from support.tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def chat_model(model_dirs, tmp_path_factory):
    """The qwen3 checkpoint plus a tokenizer, in a directory of its own: the tokenizer brings
    an EOS id, which must not leak into the other tests' models."""
    src, hf = model_dirs("qwen3")
    path = tmp_path_factory.mktemp("qwen3_chat")
    shutil.copytree(src, path, dirs_exist_ok=True)
    build_tiny_tokenizer(str(path))
    return str(path), hf


def test_text_and_chat_prompts(chat_model):
    path, hf = chat_model
    llm = LLM(path, page_size=4, num_pages=128)
    tok = llm.tokenizer
    texts = ["hello world", "the radix cache", "你好 😀 café"]
    outs = llm.generate(texts, SamplingParams(max_tokens=10), use_tqdm=False)
    for text, out in zip(texts, outs):
        ids = tok.encode(text)
        assert out["token_ids"] == hf_greedy(hf, ids, 10)
        assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = llm.apply_chat_template(chat)
    expected = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == expected
    assert llm.chat([chat], SamplingParams(max_tokens=6), use_tqdm=False)[0][
        "token_ids"
    ] == hf_greedy(hf, ids, 6)
    check_no_leak(llm.scheduler)


def test_stop_conditions(model_dirs):
    path, hf = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=128)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    free = hf_greedy(hf, prompt, 12)
    stop_at = free[5]
    first = free.index(stop_at)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=12, stop_token_ids=[stop_at]), use_tqdm=False
    )[0]
    assert out["token_ids"] == free[: first + 1] and out["finish_reason"] == "stop"
    # the model's EOS ends a request unless ignore_eos is set
    llm.scheduler.eos_token_ids = {stop_at}
    out = llm.generate([prompt], SamplingParams(max_tokens=12), use_tqdm=False)[0]
    assert out["token_ids"] == free[: first + 1] and out["finish_reason"] == "stop"
    out = llm.generate([prompt], SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert out["token_ids"] == free and out["finish_reason"] == "length"
    # max_tokens=0 finishes at once; per-prompt params
    outs = llm.generate(
        [prompt, prompt],
        [SamplingParams(max_tokens=0), SamplingParams(max_tokens=3, ignore_eos=True)],
        use_tqdm=False,
    )
    assert outs[0]["token_ids"] == [] and outs[1]["token_ids"] == free[:3]
    check_no_leak(llm.scheduler)


def test_context_limit_finishes_with_length(model_dirs):
    path, _ = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=128, max_model_len=20)
    out = llm.generate([list(range(1, 16))], SamplingParams(max_tokens=100), use_tqdm=False)[0]
    assert len(out["token_ids"]) == 5 and out["finish_reason"] == "length"


def test_dummy_weights(model_dirs):
    path, _ = model_dirs("qwen3_moe")
    llm = LLM(path, dummy_weights=True, page_size=16, num_pages=32)
    out = llm.generate([[1, 2, 3]] * 3, SamplingParams(max_tokens=5), use_tqdm=False)
    assert all(len(o["token_ids"]) == 5 for o in out)
    assert out[0]["token_ids"] == out[1]["token_ids"]  # deterministic
    check_no_leak(llm.scheduler)


ADJUSTED = dict(frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={5: 4.0}, min_tokens=3)


@pytest.mark.parametrize("overlap", ["0", "1"])
@pytest.mark.parametrize("adjusted", [False, pytest.param(True, marks=pytest.mark.ext)])
def test_graph_decode_step_run_eagerly_equals_plain_path(
    model_dirs, monkeypatch, overlap, adjusted
):
    """The decode step that CUDA graphs capture (inputs gathered from the token and page
    tables, sampling with the batch's seeds, the sampled ids written back), run eagerly on the
    CPU: the same tokens as the plain path, for greedy, temperature and top-p requests (the
    last resample outside the graph) in batches padded to the graph sizes; `adjusted`: with
    penalties, logit_bias and min_tokens (and logprobs), applied after the graph's step."""
    from minisgl.engine.graph import GraphRunner

    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", overlap)
    path, _ = model_dirs("qwen3")
    prompts = [[2 + (7 * i + j) % 97 for j in range(3 + 5 * i)] for i in range(7)]
    params = [
        SamplingParams(
            max_tokens=6 + i,
            temperature=[0.0, 0.8, 1.1][i % 3],
            top_p=0.9 if i == 4 else 1.0,
            seed=i,
            logprobs=2 if adjusted else None,
            **(ADJUSTED if adjusted and i % 2 == 0 else {}),
        )
        for i in range(7)
    ]
    outs = []
    for graphs in (False, True):
        llm = LLM(path, device="cpu", page_size=4, num_pages=128)
        if graphs:
            llm.engine.graphs = GraphRunner(llm.engine, 8, capture=False)
        res = llm.generate(prompts, params, use_tqdm=False)
        outs.append(res)
        check_no_leak(llm.scheduler)
    plain, graph = outs
    assert [o["token_ids"] for o in plain] == [o["token_ids"] for o in graph]
    for p, g in zip(plain, graph):  # logits of a padded batch differ in the last bits
        for a, b in zip(p.get("logprobs", []), g.get("logprobs", [])):
            assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)


@pytest.mark.parametrize("size", [4, 5])
def test_graph_step_equals_eager_step(model_dirs, size):
    """One decode step of greedy and temperature requests through the step that CUDA graphs
    capture (run eagerly, sampling inside the step; 5 requests are padded to the graph size 8)
    and through the plain path (sampling in Engine.sample): the same logits (bitwise when the
    graph holds the same number of rows), the same ids, written to the same token-table slots
    (the unsampled request's to the dummy row)."""
    from minisgl.core import Batch
    from minisgl.engine.graph import GraphRunner

    path, _ = model_dirs("qwen3")
    llm = LLM(path, device="cpu", page_size=4, num_pages=128)
    sched, engine = llm.scheduler, llm.engine
    prompts = [[2 + (7 * i + j) % 97 for j in range(3 + 5 * i)] for i in range(size)]
    params = [SamplingParams(temperature=[0.0, 1.5][i % 2], seed=i) for i in range(size)]
    reqs = [sched.make_request(p, sp) for p, sp in zip(prompts, params)]
    for req in reqs:  # prefill all but the last prompt token, which the decode step computes
        sched.planner.admit(req)
        assert sched.planner.grow(req, req.remaining_len)
        req.extend_len = req.remaining_len - 1
    engine.forward(Batch(reqs, "prefill"))
    for req in reqs:
        req.cached_len, req.extend_len = len(req.tokens) - 1, 1
    samples = [True] * (size - 1) + [False]
    rows = [r.table_idx for r in reqs]
    slots = [len(r.tokens) for r in reqs]
    results = []
    for graphs in (GraphRunner(engine, 8, capture=False), None):
        engine.graphs = graphs
        engine.token_table[rows, slots] = -1
        batch = Batch(reqs, "decode")
        out = engine.forward(batch, samples)
        assert (out.sampled is None) == (graphs is None)
        logits = out.logits.clone()
        tokens = engine.sample(batch, out).tokens()
        results.append((logits, tokens, engine.token_table[rows, slots].tolist()))
    (graph_logits, graph_tokens, graph_written), (logits, tokens, written) = results
    tolerance = 0 if size == 4 else 1e-5  # a padded batch may round its GEMMs differently
    torch.testing.assert_close(graph_logits, logits, atol=tolerance, rtol=0)
    assert graph_tokens == tokens and graph_written == written
    assert written == tokens[:-1] + [-1]
    for req in reqs:
        req.cached_len = len(req.tokens)
        sched.planner.release(req)
    check_no_leak(sched)


def test_n_samples_per_prompt(chat_model):
    path, _ = chat_model
    llm = LLM(path, page_size=4, num_pages=128)
    prompts = ["hello world", "the radix cache"]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=8, n=3), use_tqdm=False)
    assert len(greedy) == len(prompts)
    for prompt, out in zip(prompts, greedy):
        single = llm.generate([prompt], SamplingParams(max_tokens=8), use_tqdm=False)[0]
        assert out["outputs"] == [single] * 3  # vLLM's RequestOutput.outputs
    seeded = SamplingParams(max_tokens=8, n=4, temperature=1.0, top_k=-1, seed=7)
    outs = llm.generate(prompts[0], seeded, use_tqdm=False)[0]["outputs"]
    assert len({tuple(o["token_ids"]) for o in outs}) > 1
    assert llm.generate(prompts[0], seeded, use_tqdm=False)[0]["outputs"] == outs
    # sample j is seeded seed + j, as the server seeds choice j
    one = SamplingParams(max_tokens=8, temperature=1.0, seed=9)
    assert llm.generate(prompts[0], one, use_tqdm=False)[0] == outs[2]
    check_no_leak(llm.scheduler)


def test_stop_strings_cut_as_the_server_does(chat_model):
    path, _ = chat_model
    llm = LLM(path, page_size=4, num_pages=128)
    prompt = "hello world"
    free = llm.generate([prompt], SamplingParams(max_tokens=12), use_tqdm=False)[0]
    ids, text = free["token_ids"], free["text"]
    stop = text[len(text) // 2 :][:2]  # from the middle of the output: it does occur
    assert stop and stop in text
    cut = text[: text.index(stop)]
    for stops in (stop, [stop, "never in it"]):
        out = llm.generate([prompt], SamplingParams(max_tokens=12, stop=stops), use_tqdm=False)[0]
        assert out["text"] == cut and out["finish_reason"] == "stop"
        assert ids[: len(out["token_ids"])] == out["token_ids"]  # ends on the completing token
        assert stop in llm.tokenizer.decode(out["token_ids"])
    check_no_leak(llm.scheduler)


@pytest.mark.ext  # min_tokens: the sampling extension
def test_min_tokens_past_a_stop_string(chat_model):
    """min_tokens past the stop string: the detokenizer (the server's) decides where it ends."""
    path, _ = chat_model
    llm = LLM(path, page_size=4, num_pages=128)
    free = llm.generate(["hello world"], SamplingParams(max_tokens=12), use_tqdm=False)[0]
    ids, text = free["token_ids"], free["text"]
    stop = text[len(text) // 2 :][:2]
    params = SamplingParams(max_tokens=12, stop=[stop], min_tokens=len(ids))
    out = llm.generate(["hello world"], params, use_tqdm=False)[0]
    assert out == free
    check_no_leak(llm.scheduler)


@pytest.mark.ext  # grammars and min_tokens: the structured and sampling extensions
def test_grammar_end_wins_over_min_tokens(chat_model):
    """A grammar that is complete allows only its end, which min_tokens holds back: the grammar
    wins and the request stops (found by the server fuzz as a 500, "token 0 does not match the
    grammar"). Seeded sampling, so each seed is one case."""
    path, _ = chat_model
    llm = LLM(path, page_size=4, num_pages=128)
    try:
        for seed in range(4):
            params = SamplingParams(
                regex="[0-9]", min_tokens=3, max_tokens=6, temperature=0.8, seed=seed
            )
            (out,) = llm.generate(["0000"], params, use_tqdm=False)
            assert out["finish_reason"] == "stop" and "error" not in out, out
            assert len(out["text"]) == 1 and out["text"].isdigit(), out
            # without the conflict min_tokens still holds: a longer pattern runs past it
            params = SamplingParams(regex="[0-9]{8}", min_tokens=3, max_tokens=12, seed=seed)
            (out,) = llm.generate(["0000"], params, use_tqdm=False)
            assert out["finish_reason"] == "stop" and len(out["text"]) == 8, out
    finally:
        llm.shutdown()


@pytest.mark.ext  # ext/perf's (the llm_defaults point)
def test_offline_chunks_are_longer_on_a_big_gpu(monkeypatch):
    """LLM on a GPU of >= 70 GiB computes prompt chunks of 32k tokens; a budget given keeps
    both as given (the other one to the scheduler's default), and a CPU is no big GPU."""
    import minisgl.ext.perf.offline as offline

    assert not offline.big_gpu("cpu") and (torch.cuda.is_available() or not offline.big_gpu("cuda"))
    _, sched = LLM.configs("m", {})
    assert (sched.max_prefill_tokens, sched.max_num_batched_tokens) == (None, None)
    monkeypatch.setattr(offline, "big_gpu", lambda device: True)
    _, sched = LLM.configs("m", {})
    assert (sched.max_prefill_tokens, sched.max_num_batched_tokens) == (32768, 32768)
    _, sched = LLM.configs("m", {"max_num_batched_tokens": 4096})
    assert (sched.max_prefill_tokens, sched.max_num_batched_tokens) == (None, 4096)


@pytest.mark.ext  # ext/perf's (the scheduler_config point)
@pytest.mark.parametrize("big", [True, False])
def test_small_models_get_longer_steps_on_a_big_gpu(model_dirs, monkeypatch, big):
    """A model under a billion parameters on a GPU of >= 70 GiB plans 16k-token steps where
    the budgets are not given (the server's path: build_scheduler); a budget given stays, a
    larger model or a smaller GPU keeps 8192."""
    import minisgl.ext.perf.budgets as budgets
    import minisgl.ext.perf.offline as offline
    from minisgl.engine.config import EngineConfig
    from minisgl.scheduler.config import SchedulerConfig
    from minisgl.scheduler.io import build_scheduler

    monkeypatch.setattr(offline, "big_gpu", lambda device: big)
    path, _ = model_dirs("qwen3")
    engine = EngineConfig(model=path, device="cpu", num_pages=64, page_size=4)

    def planned(params: int = budgets.SMALL_MODEL_PARAMS - 1, **options) -> tuple[int, int]:
        monkeypatch.setattr(budgets, "SMALL_MODEL_PARAMS", params)
        s = build_scheduler(engine, SchedulerConfig(**options), rank=0, tp=1)
        s.engine.shutdown()
        return s.planner.max_prefill_tokens, s.planner.max_batched_tokens

    long, default = (16384, 16384) if big else (8192, 8192), (8192, 8192)
    assert planned() == long
    assert planned(max_prefill_tokens=24) == (24, long[1])
    assert planned(max_prefill_tokens=8192, max_num_batched_tokens=8192) == default
    assert planned(params=1) == default  # the tiny model "of a billion parameters or more"
    monkeypatch.setattr(budgets, "all_reduce_min", lambda value: 0)  # a TP rank's GPU is small
    assert planned() == default


def test_steps_keep_8192_tokens_without_the_extension(core_alone, model_dirs):
    """The core alone has no big-GPU rule: LLM's budgets are 8192 on any device, as given
    otherwise."""
    from minisgl.extension import extensions

    assert extensions().llm_defaults is None and not extensions().scheduler_config
    _, sched = LLM.configs("m", {"device": "cuda"})
    assert (sched.max_prefill_tokens, sched.max_num_batched_tokens) == (None, None)
    llm = LLM(model_dirs("qwen3")[0], device="cpu", num_pages=64, page_size=4)
    assert (llm.scheduler.planner.max_prefill_tokens, llm.scheduler.planner.max_batched_tokens) == (
        8192,
        8192,
    )
    llm.shutdown()


@pytest.mark.ext  # ext/perf's (the offline_run point)
def test_generate_steps_without_automatic_collection(model_dirs, monkeypatch):
    """While `generate` steps, the collector is off (a full collection would walk every output
    gathered so far); after it, on again as it was."""
    import gc

    path, _ = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=64)
    step, collecting = llm.scheduler.step, []

    def recording_step():
        collecting.append(gc.isenabled())
        return step()

    monkeypatch.setattr(llm.scheduler, "step", recording_step)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3), use_tqdm=False)
    assert collecting and not any(collecting) and gc.isenabled()
