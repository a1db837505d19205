"""Tensor parallelism on CPU: 2 gloo ranks (this process and one spawned worker) give the
same greedy tokens as TP=1 and as transformers; bad TP sizes fail before any process starts;
no worker outlives shutdown."""

import json
import multiprocessing as mp
import os
import sys

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.distributed import get_tp_info
from minisgl.utils.procs import wait_ready
from support.invariants import check_no_leak
from support.models import hf_greedy
from support.server import make_tiny_model, run_server

PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6], [7, 7, 8, 100, 200, 3, 9, 9, 9, 10, 11]]
ENGINE = dict(page_size=4, num_pages=64, max_prefill_tokens=8)  # 8: the long prompt is chunked


@pytest.mark.parametrize("arch", ["llama", "llama_mqa", "qwen3", "qwen3_moe"])
def test_tp2_matches_tp1_and_transformers(model_dirs, arch):
    path, hf = model_dirs(arch)
    greedy = SamplingParams(max_tokens=10)
    seeded = SamplingParams(max_tokens=10, temperature=1.0, top_k=50, seed=7)
    params = [greedy, greedy, seeded]
    prompts = [*PROMPTS, PROMPTS[0]]
    single = LLM(path, **ENGINE).generate(prompts, params, use_tqdm=False)
    llm = LLM(path, tp=2, **ENGINE)
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
        again = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)  # the ranks still agree
        check_no_leak(llm.scheduler)
    finally:
        workers = list(llm.workers)
        llm.shutdown()
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in single]
    for prompt, out in zip(PROMPTS, outs):
        assert out["token_ids"] == hf_greedy(hf, prompt, 10)
    assert again[0]["token_ids"] == outs[0]["token_ids"]
    assert [w.exitcode for w in workers] == [0]  # stopped by rank 0's word, not killed
    assert get_tp_info().size == 1  # the process is back to TP=1


def test_unseeded_sampling_seed_comes_from_rank_0(model_dirs):
    """A seed drawn at random must reach the other ranks with the request."""
    llm = LLM(model_dirs("llama")[0], tp=2, **ENGINE)
    try:
        stop = list(range(0, 512, 2))  # a random token ends it early: the ranks must agree when
        sp = SamplingParams(max_tokens=20, temperature=1.0, stop_token_ids=stop)
        reqs = [llm.scheduler.make_request(PROMPTS[0], sp) for _ in range(4)]
        for req in reqs:
            llm.scheduler.add_request(req)
        assert [c.params.seed for c in llm.scheduler.leader.changes] == [r.seed for r in reqs]
        while llm.scheduler.has_work:
            llm.scheduler.step()
        assert all(r.finished for r in reqs)
    finally:
        llm.shutdown()


def test_tp2_prefix_cache_flush_reaches_every_rank(model_dirs):
    """`LLM.reset_prefix_cache` empties every rank's cache before their next step: a follower
    that kept its cache would match a longer prefix than rank 0, and the ranks' batches (and
    collectives) would differ."""
    llm = LLM(model_dirs("llama")[0], tp=2, **ENGINE)
    params = SamplingParams(max_tokens=6)
    try:
        first = llm.generate(PROMPTS, params, use_tqdm=False)
        llm.reset_prefix_cache()
        assert llm.scheduler.cache.prefix_cache.num_pages == 0
        again = llm.generate(PROMPTS, params, use_tqdm=False)
        check_no_leak(llm.scheduler)
    finally:
        workers = list(llm.workers)
        llm.shutdown()
    assert [o["token_ids"] for o in again] == [o["token_ids"] for o in first]
    assert [w.exitcode for w in workers] == [0]


@pytest.mark.ext  # grammars: the structured extension
def test_tp2_admits_a_compiled_grammar_on_every_rank_at_once(tmp_path):
    """Issue 52: each rank compiles a constrained request's grammar from its add; rank 0 admits
    it once compiled there and tells the others (same step on every rank), while plain requests
    run; a grammar that overruns --grammar-compile-timeout ends on rank 0 with an error and on
    the follower as an abort. The ranks agree all along and afterwards."""
    import re

    from transformers import AutoTokenizer

    model = make_tiny_model(str(tmp_path / "m"))
    llm = LLM(model, tp=2, grammar_compile_timeout=2, **ENGINE)
    try:
        sched = llm.scheduler
        nested = '{"type":"array","items":' * 1100 + '{"type":"integer"}' + "}" * 1100
        hog = sched.make_request(PROMPTS[0], SamplingParams(max_tokens=8, json_schema=nested))
        small = sched.make_request(PROMPTS[1], SamplingParams(max_tokens=20, regex="[ab]{3}"))
        plain = [sched.make_request(p, SamplingParams(max_tokens=10)) for p in PROMPTS]
        for req in [hog, small, *plain]:
            sched.add_request(req)
        while sched.has_work:  # only grammars compiling: a step waits a little (no spin)
            sched.step()
        assert hog.finish_reason == "error"
        assert hog.error == "grammar compilation took longer than 2 s"
        tokenizer = AutoTokenizer.from_pretrained(model)
        text = tokenizer.decode(small.output_ids, skip_special_tokens=True)
        assert small.finish_reason == "stop" and re.fullmatch("[ab]{3}", text), text
        assert [r.finish_reason for r in plain] == ["length", "length"]
        check_no_leak(sched)
        again = llm.generate(PROMPTS, SamplingParams(max_tokens=10), use_tqdm=False)
        assert [o["token_ids"] for o in again] == [r.output_ids for r in plain]
    finally:
        llm.shutdown()


def _config_only(src: str, dst: str, **changes) -> str:
    os.makedirs(dst)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump({**config, **changes}, f)
    return dst


def test_bad_tp_sizes_fail_before_spawning(model_dirs, tmp_path):
    path = model_dirs("llama")[0]
    with pytest.raises(
        ValueError, match=r"num_attention_heads \(4\) is not divisible by TP size 3"
    ):
        LLM(path, tp=3, **ENGINE)
    odd = _config_only(
        path, str(tmp_path / "odd"), num_attention_heads=6, num_key_value_heads=3, hidden_size=96
    )
    with pytest.raises(ValueError, match=r"num_key_value_heads \(3\) and TP size 2"):
        LLM(odd, tp=2, **ENGINE)
    fewer = _config_only(path, str(tmp_path / "fewer"), num_attention_heads=6, hidden_size=96)
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) and TP size 3: one must"):
        LLM(fewer, tp=3, **ENGINE)  # fewer KV heads than ranks, and 3 not a multiple of 2
    with pytest.raises(ValueError, match="invalid TP size 0"):
        LLM(path, tp=0, **ENGINE)
    assert mp.active_children() == [] and get_tp_info().size == 1


def test_dead_worker_is_an_error_not_a_hang():
    ctx = mp.get_context("spawn")
    conn, _child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=sys.exit, args=(3,), name="TP rank 1")
    proc.start()
    with pytest.raises(
        RuntimeError, match=r"TP rank 1 process exited during start-up \(exit code 3\)"
    ):
        wait_ready([conn], [proc])


def test_server_tp2_answers(tmp_path, model_dirs):
    """`--tp 2`: two scheduler processes; the answer equals transformers; none survives."""
    import httpx
    from transformers import AutoTokenizer

    _, hf = model_dirs("qwen3")
    model = make_tiny_model(str(tmp_path / "m"))
    args = ["--device", "cpu", "--tp", "2", "--num-pages", "64", "--page-size", "4"]
    with run_server(model, *args, log_path=str(tmp_path / "log")) as server:
        assert "scheduler_1 process started" in server.log()
        body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6
        tokenizer = AutoTokenizer.from_pretrained(model)
        expected = tokenizer.decode(hf_greedy(hf, PROMPTS[0], 6), skip_special_tokens=True)
        assert r.json()["choices"][0]["text"] == expected


def test_server_bad_tp_exits_1(model_dirs):
    import subprocess

    from support.server import REPO

    path = model_dirs("llama")[0]
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    cmd = [sys.executable, "-m", "minisgl", "--model", path, "--device", "cpu", "--tp", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "num_attention_heads (4) is not divisible by TP size 3" in out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_tp2_on_two_gpus_matches_tp1(model_dirs, arch):
    """NCCL ranks on GPUs 0 and 1 (CUDA graphs on) give TP=1's greedy tokens, float32."""
    path, _ = model_dirs(arch)
    kwargs = dict(device="cuda", dtype="float32", page_size=4, num_pages=256)
    params = SamplingParams(max_tokens=12)
    single = LLM(path, **kwargs).generate(PROMPTS, params, use_tqdm=False)
    llm = LLM(path, tp=2, **kwargs)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert [o["token_ids"] for o in outs] == [o["token_ids"] for o in single]


def test_cuda_tp_larger_than_device_count_is_refused(model_dirs):
    path, n = model_dirs("llama")[0], torch.cuda.device_count()  # 0 without CUDA
    tp = max(2, 2 * n)
    with pytest.raises(ValueError, match=f"TP size {tp} needs {tp} GPUs, found {n}"):
        LLM(path, tp=tp, device="cuda")
    assert mp.active_children() == []
