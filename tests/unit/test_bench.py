"""The offline benchmark script: its roofline model and a CPU smoke run on a tiny model."""

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))

import bench  # noqa: E402
from bench import GPU_PEAKS, TINY_QWEN3, roofline_tok_s, workload  # noqa: E402


def test_workload_is_the_published_one():
    prompts, max_tokens = workload(256, 1024, 1024)
    assert sum(max_tokens) == 133_966
    assert all(100 <= len(p) <= 1024 for p in prompts)


def test_roofline_of_qwen3_0_6b_on_h100():
    prompts, max_tokens = workload(256, 1024, 1024)
    params = 596_049_920  # Qwen3-0.6B, tied embeddings counted once
    kv_per_token = 2 * 28 * 8 * 128 * 2
    roof = roofline_tok_s(
        [len(p) for p in prompts],
        max_tokens,
        2 * params,
        kv_per_token,
        params,
        *GPU_PEAKS["H100 80GB HBM3"],
    )
    assert abs(roof - 28_575) / 28_575 < 0.005  # the figure the issue quotes


def test_roofline_counts_prompt_attention_and_no_embedding_flops():
    """Since 2026-12-01 a prompt token costs its weights' FLOPs without the embedding (a lookup)
    and the LM head (once a prompt), plus the causal attention: for the long-prompt workload of
    issue 49 on an H200, 2,898 tok/s against the 3,550 the weights alone gave."""
    bw, flops = GPU_PEAKS["H200"]
    params, vocab, pair = 596_049_920, 151_936 * 1024, 4 * 16 * 128 * 28  # Qwen3-0.6B
    terms = dict(vocab_params=vocab, head_params=vocab, attn_flops_per_pair=pair)
    kv_per_token = 2 * 28 * 8 * 128 * 2

    def roof(workload_args: tuple[int, int, int], **kw: float) -> float:
        prompts, max_tokens = workload(*workload_args)
        lens = [len(p) for p in prompts]
        return roofline_tok_s(lens, max_tokens, 2 * params, kv_per_token, params, bw, flops, **kw)

    assert abs(roof((64, 16000, 128)) - 3_550) < 1  # the figure issue 49 quotes
    assert abs(roof((64, 16000, 128), **terms) - 2_898) < 1
    assert abs(roof((256, 1024, 1024), **terms) - 40_771) < 1  # default: 40,360 before
    # one prompt of 3 tokens, one output token: each term by hand
    one = roofline_tok_s([3], [1], 0.0, 0.0, 10.0, 1.0, 1.0, vocab_params=4, head_params=2,
                         attn_flops_per_pair=5)  # fmt: skip
    assert abs(1 / one - (3 * 2 * 6 + 2 * 2 + 6 * 5)) < 1e-9


@pytest.mark.parametrize("tied", [True, False])
def test_roofline_reads_the_terms_off_the_engine(tied):
    """`roofline` finds the vocabulary's parameters (a tied LM head once) and the attention's
    shape on the engine, per rank at --tp 2, and --old-roofline gives the earlier model."""

    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = torch.nn.Module()
            self.model.embed_tokens = torch.nn.Embedding(100, 8)
            self.model.layer = torch.nn.Linear(8, 8, bias=False)
            self.lm_head = torch.nn.Linear(8, 100, bias=False)
            if tied:
                self.lm_head.weight = self.model.embed_tokens.weight

    kv = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.bfloat16)
    config = SimpleNamespace(moe=None, num_heads=4)
    engine = SimpleNamespace(model=Tiny().bfloat16(), kv_cache=kv, model_config=config)
    prompts, outputs = [[0] * 10, [0] * 3], [2, 1]
    got = bench.roofline(engine, "NVIDIA H200", prompts, outputs, 1.0, tp_size=2)
    params = 800 + 64 + (0 if tied else 800)
    want = roofline_tok_s(
        [10, 3], outputs, 2 * params, 2 * 2 * 1 * 4 * 2, params, *GPU_PEAKS["H200"],
        vocab_params=800 * (1 if tied else 2), head_params=800,
        attn_flops_per_pair=4 * 2 * 4 * 2,
    )  # fmt: skip
    assert got["roofline_tok_s"] == round(want, 1) and got["roofline_model"] == "params+attention"
    old = bench.roofline(engine, "NVIDIA H200", prompts, outputs, 1.0, tp_size=2, old=True)
    plain = roofline_tok_s([10, 3], outputs, 2 * params, 32, params, *GPU_PEAKS["H200"])
    assert old["roofline_tok_s"] == round(plain, 1) and old["roofline_model"] == "params"


def test_moe_roofline_counts_the_experts_a_step_reads():
    bw, flops = GPU_PEAKS["H200"]
    # one request, 100 prompt tokens, 2 output tokens; a token uses a quarter of the experts
    roof = roofline_tok_s([100], [2], 1e9, 1e5, 5e8, bw, flops, 4e9, 2e9, expert_share=0.25)
    prefill = 100 * 2 * (5e8 + 0.25 * 2e9) / flops
    steps = sum((1e9 + 0.25 * 4e9 + (100 + s) * 1e5) / bw for s in (1, 2))
    assert abs(roof - 2 / (prefill + steps)) / roof < 1e-12
    # a batch of b requests reads the experts some request routes to: 1 - (1 - 1/4)^b of them
    prompts, outputs = [100] * 8, [1] * 8
    roof = roofline_tok_s(prompts, outputs, 1e9, 0.0, 5e8, bw, flops, 4e9, 2e9, expert_share=0.25)
    step = (1e9 + 4e9 * (1 - 0.75**8)) / bw
    assert abs(roof - 8 / (8 * 100 * 2 * 1e9 / flops + step)) / roof < 1e-12
    # every expert used by every token: the same as dense weights
    dense = roofline_tok_s(prompts, [5] * 8, 5e9, 1e5, 2.5e9, bw, flops)
    moe = roofline_tok_s(prompts, [5] * 8, 1e9, 1e5, 5e8, bw, flops, 4e9, 2e9, expert_share=1.0)
    assert abs(moe - dense) / dense < 1e-12


def run_bench(args: list[str], out: Path) -> tuple[dict, str]:
    """bench.py as its own process: the script whole (its command line, __main__, --json)."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "offline", "bench.py"), *args]
    cmd += ["--device", "cpu", "--json", str(out)]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text()), proc.stdout


def in_process(main: Callable[[], None], argv: list[str], monkeypatch: pytest.MonkeyPatch) -> str:
    """A benchmark script's `main` with `argv` as its command line, in this process: the same
    code as the script's own process below its entry, without the seconds a new process spends
    importing torch and minisgl (issue 47); the environment is restored after (bench.py's
    ablation switches set variables). What it printed."""
    monkeypatch.setattr(sys, "argv", [main.__module__ + ".py", *argv])
    env, printed = dict(os.environ), io.StringIO()
    try:
        with contextlib.redirect_stdout(printed):
            main()
    finally:
        os.environ.clear()
        os.environ.update(env)
    return printed.getvalue()


def bench_main(args: list[str], out: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    """bench.py's main on the CPU without warm-up (no kernel compiles there), in this process;
    its --json line."""
    in_process(
        bench.main, [*args, "--device", "cpu", "--warmup", "0", "--json", str(out)], monkeypatch
    )
    return json.loads(out.read_text())


def test_cpu_smoke_run(tmp_path: Path) -> None:
    """The script as a process, with the warm-up, two timed runs and random LoRA adapters."""
    args = ["--tiny", "--num-seqs", "3", "--max-input-len", "110", "--max-output-len", "104"]
    args += ["--repeat", "2", "--note", "x", "--lora-adapters", "2", "--lora-rank", "8"]
    result, stdout = run_bench(args, tmp_path / "result.jsonl")
    assert result["output_tokens"] == sum(workload(3, 110, 104)[1])
    # the line says when, on what and how it ran (results.jsonl's fields)
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", result["date"]) and result["note"] == "x"
    assert result["command"].startswith("python benchmark/offline/bench.py --tiny")
    assert result["commit"] is None or re.fullmatch(r"[0-9a-f]{4,}(\+dirty)?", result["commit"])
    assert len(result["runs_s"]) == 2 and min(result["runs_s"]) <= result["seconds"]
    assert result["prefix_cached_tokens"] == 0  # the repeat shares no prefix with the first run
    assert result["tok_s"] > 0 and "tok/s" in stdout
    assert (result["model"], result["tp"], result["moe_backend"]) == ("tiny", 1, None)
    assert result["mixed_steps"] is True and result["max_num_batched_tokens"] == 8192
    assert result["prefill_graphs"] is True and result["warmup"] == 24
    assert result["gemv_max_m"] is None  # --gemv-max-m not given: the default bound
    # --lora-adapters: the requests ran on random adapters served with enable_lora
    assert (result["lora_adapters"], result["lora_rank"]) == (2, 8)


def test_cpu_smoke_run_speculative(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--speculative-algorithm: the target drafting for itself accepts every proposal (the
    accept length is K + 1 but where max_tokens cuts a step short); random proposals none."""
    args = ["--tiny", "--single", "--max-output-len", "100", "--speculative-num-draft-tokens"]
    standalone = [*args, "4", "--speculative-algorithm", "standalone"]
    result = bench_main(standalone, tmp_path / "a", monkeypatch)
    assert result["output_tokens"] == 100 and result["speculative"] == "standalone"
    assert result["spec_accepted_tokens"] == result["spec_draft_tokens"] > 0
    assert 4.5 < result["spec_accept_length"] <= 5 and result["overlap"] is True
    random = [*args, "2", "--speculative-algorithm", "random"]
    result = bench_main([*random, "--speculative-max-backoff", "0"], tmp_path / "b", monkeypatch)
    assert result["output_tokens"] == 100 and result["spec_draft_tokens"] >= 2 * 90
    assert result["spec_accept_length"] < 1.1  # a random id matches the target's ~1 in 10^4
    assert result["overlap"] is False and result["max_backoff"] == 0
    result = bench_main(random, tmp_path / "d", monkeypatch)  # backing off: every 17 steps
    assert result["max_backoff"] == 16 and 2 * 6 <= result["spec_draft_tokens"] <= 2 * 12
    oracle = [*args, "4", "--speculative-algorithm", "oracle"]
    result = bench_main(oracle, tmp_path / "c", monkeypatch)
    assert result["output_tokens"] == 100 and result["prefix_cached_tokens"] == 0
    assert result["spec_accepted_tokens"] == result["spec_draft_tokens"] > 0  # all, free
    assert 4.5 < result["spec_accept_length"] <= 5


def test_cpu_smoke_run_half_constrained(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--grammar-frac: a dummy model without tokenizer gets a synthetic xgrammar vocabulary;
    every other request writes JSON under BENCH_SCHEMA (the rest run unconstrained)."""
    args = ["--tiny", "--num-seqs", "4", "--max-input-len", "110", "--max-output-len", "104"]
    args += ["--grammar-frac", "0.5", "--disable-mixed-steps", "--disable-prefill-graphs"]
    result = bench_main(args, tmp_path / "result.jsonl", monkeypatch)
    assert result["grammar_frac"] == 0.5 and result["mixed_steps"] is False
    assert result["prefill_graphs"] is False
    # at most the two constrained requests end early, when the random text closes the JSON
    assert 0 <= result["ended_by_grammar"] <= 2
    assert result["output_tokens"] <= sum(workload(4, 110, 104)[1])
    assert (result["lora_adapters"], result["lora_rank"]) == (0, None)  # no LoRA by default


def test_cpu_smoke_run_lora(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--single --lora-adapters 1: the one request on adapter 0, of the default rank."""
    single = ["--tiny", "--single", "--max-output-len", "100", "--lora-adapters", "1"]
    result = bench_main(single, tmp_path / "s", monkeypatch)
    assert (result["output_tokens"], result["lora_adapters"], result["lora_rank"]) == (100, 1, 16)


def test_bench_lora_adapters_are_random_peft_adapters_of_the_model(tmp_path):
    """Every projection of every layer, B not zero, each adapter its own; request i on i % N."""
    from bench import adapted, tiny_model_dir, write_adapters
    from transformers import AutoConfig

    from minisgl.ext.lora.adapter import TARGETS, load_adapter
    from minisgl.models.config import ModelConfig

    model = tiny_model_dir()
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model))
    paths = write_adapters(model, 2, 8)
    adapters = [load_adapter(f"a{n}", p, config, 8) for n, p in enumerate(paths)]
    for adapter in adapters:
        assert set(adapter.weights) == {(i, m) for i in range(2) for m in TARGETS}
        assert adapter.rank == 8 and all(w.b.abs().sum() > 0 for w in adapter.weights.values())
    first, second = (a.weights[(0, "q_proj")].b for a in adapters)
    assert not first.equal(second)
    assert [adapted(2)(i) for i in range(3)] == [{"lora_name": f"bench{n}"} for n in (0, 1, 0)]
    assert adapted(0)(5) == {} and write_adapters(model, 0, 8) == []


def test_cpu_smoke_run_moe_config_tp2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--config DIR (config.json only, dummy weights), --tp and --moe-backend reach the engine."""
    from transformers import Qwen3MoeConfig

    model = tmp_path / "tiny-moe"
    config = Qwen3MoeConfig(
        **TINY_QWEN3, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32
    )
    config.architectures = ["Qwen3MoeForCausalLM"]
    config.save_pretrained(model)
    args = ["--config", str(model), "--tp", "2", "--moe-backend", "torch", "--num-seqs", "2"]
    args += ["--max-input-len", "104", "--max-output-len", "102"]
    result = bench_main(args, tmp_path / "result.jsonl", monkeypatch)
    assert result["output_tokens"] == sum(workload(2, 104, 102)[1])
    assert (result["model"], result["tp"], result["moe_backend"]) == ("tiny-moe", 2, "torch")


def test_page_size_reaches_the_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--page-size is the engine's page size and goes into the JSON line (absent: LLM's)."""
    import minisgl

    sizes = []

    class Spy(minisgl.LLM):
        def __init__(self, *args, **options):
            super().__init__(*args, **options)
            sizes.append(self.engine.page_size)

    monkeypatch.setattr(minisgl, "LLM", Spy)
    args = ["--tiny", "--num-seqs", "2", "--max-input-len", "104", "--max-output-len", "102"]
    result = bench_main([*args, "--page-size", "4"], tmp_path / "a.jsonl", monkeypatch)
    assert result["page_size"] == 4 and result["output_tokens"] == sum(workload(2, 104, 102)[1])
    assert bench_main(args, tmp_path / "b.jsonl", monkeypatch)["page_size"] is None
    assert sizes == [4, 16]


def test_step_times_group_the_steps_and_sum_the_gpu_idle(monkeypatch):
    """step_times.py's summary: per kind of step its count, host and GPU ms a step and the idle
    before it (CUDA events faked as times in seconds); none before a run's first step."""
    import step_times

    class Mark:
        def __init__(self, t: float) -> None:
            self.t = t

        def elapsed_time(self, later: "Mark") -> float:  # ms, as CUDA events give it
            return (later.t - self.t) * 1e3

        def synchronize(self) -> None:
            pass

    def batch(size: int, decode: bool, decodes: int = 0) -> Any:
        return SimpleNamespace(is_decode=decode, size=size, num_decodes=decodes)

    kinds = [step_times.kind(batch(n, True)) for n in (1, 2, 3, 4, 255, 256)]
    assert kinds[:4] == ["decode 1 row", "decode 2-3 rows", "decode 2-3 rows", "decode 4-7 rows"]
    assert kinds[4:] == ["decode 128-255 rows", "decode 256-511 rows"]
    assert step_times.kind(batch(9, False)) == "prefill"
    assert step_times.kind(batch(9, False, 4)) == "mixed"
    run = [("prefill", 0.020, Mark(0.0), Mark(0.060)), ("decode 4-7 rows", 0.001, Mark(0.061),
           Mark(0.065)), ("decode 4-7 rows", 0.003, Mark(0.067), Mark(0.070))]  # fmt: skip
    lines = step_times.summary([run, run[:1]])
    assert lines[1:] == [
        "  prefill: 2, 20.00, 60.00, 0.000",
        "  decode 4-7 rows: 2, 2.00, 3.50, 0.003",
        "GPU idle between steps: 0.003 s in all",
    ]
    cpu = step_times.summary([[(name, host, None, None) for name, host, _, _ in run]])
    assert "no GPU times" in cpu[0] and cpu[1:] == [
        "  prefill: 1, 20.00",
        "  decode 4-7 rows: 2, 2.00",
    ]


def test_bench_step_times_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """--step-times prints every step of the timed runs by kind (host times only on a CPU)."""
    args = ["--tiny", "--num-seqs", "2", "--max-input-len", "104", "--max-output-len", "102"]
    argv = [*args, "--step-times", "--device", "cpu", "--warmup", "0"]
    printed = in_process(bench.main, [*argv, "--json", str(tmp_path / "r.jsonl")], monkeypatch)
    lines = printed.splitlines()
    first = lines.index("steps of 1 run(s): count, host ms a step (no CUDA: no GPU times)")
    kinds = dict(line.strip().split(": ") for line in lines[first + 1 :] if line.startswith("  "))
    assert "prefill" in kinds and any(name.startswith("decode") for name in kinds)
    # one prefill step samples each request's first token, a decode step each next one
    outputs = sum(workload(2, 104, 102)[1])
    assert sum(int(cells.split(",")[0]) for cells in kinds.values()) < outputs
    with pytest.raises(SystemExit) as refused:  # the replicas step in their own processes
        in_process(bench.main, [*argv, "--dp", "2"], monkeypatch)
    assert refused.value.code == 2


def test_benchmark_configs_are_the_published_ones():
    from transformers import AutoConfig

    from minisgl.models.config import ModelConfig

    dense = ModelConfig.from_hf(AutoConfig.from_pretrained(f"{ROOT}/benchmark/qwen3-8b"))
    assert (dense.hidden_size, dense.num_layers, dense.intermediate_size) == (4096, 36, 12288)
    assert (dense.num_heads, dense.num_kv_heads, dense.head_dim) == (32, 8, 128)
    assert (dense.vocab_size, dense.tie_word_embeddings, dense.moe) == (151936, False, None)
    moe = ModelConfig.from_hf(AutoConfig.from_pretrained(f"{ROOT}/benchmark/qwen3-30b-a3b"))
    assert (moe.hidden_size, moe.num_layers, moe.num_heads, moe.num_kv_heads) == (2048, 48, 32, 4)
    assert moe.moe is not None and moe.moe.sparse_layers == tuple(range(48))
    assert (moe.moe.num_experts, moe.moe.top_k, moe.moe.intermediate_size) == (128, 8, 768)
    assert moe.moe.norm_topk_prob and moe.rope.base == 1e6 == dense.rope.base


def test_first_token_bench_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_ttft.py: one line per prompt length, with and without prefill graphs."""
    import bench_ttft

    out = tmp_path / "ttft.jsonl"
    for ablation in ([], ["--disable-prefill-graphs"]):
        argv = ["--tiny", "--device", "cpu", "--lens", "4,40", "--runs", "2", *ablation]
        printed = in_process(bench_ttft.main, [*argv, "--json", str(out)], monkeypatch)
        assert "prompt 40: first token" in printed
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(x["prompt_tokens"], x["prefill_graphs"]) for x in lines] == [
        (4, True),
        (40, True),
        (4, False),
        (40, False),
    ]
    assert all(x["first_token_ms"] > 0 and x["eight_tokens_ms"] > 0 for x in lines)


def test_gemv_max_m_out_of_range_is_refused():
    """--gemv-max-m outside the GEMV's 1..64 rows, a negative --warmup: a usage error naming
    the flag, before any model loads."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "offline", "bench.py")]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    for bad in ("0", "65"):
        proc = subprocess.run(
            [*cmd, "--tiny", "--gemv-max-m", bad], capture_output=True, text=True, env=env
        )
        assert proc.returncode == 2 and f"--gemv-max-m {bad}:" in proc.stderr, proc.stderr
    warmup = [*cmd, "--tiny", "--warmup", "-1"]
    proc = subprocess.run(warmup, capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "--warmup -1: must be >= 0" in proc.stderr, proc.stderr


def test_gemm_first_call_bench_reads_the_layer_shapes_from_the_config():
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "kernels"))
    from gemm_first_call_bench import linear_shapes

    shapes = linear_shapes(os.path.join(ROOT, "benchmark", "qwen3-0.6b"))
    assert shapes == {
        "qkv": (4096, 1024),
        "o": (1024, 2048),
        "gate_up": (6144, 1024),
        "down": (1024, 3072),
        "lm_head": (151936, 1024),
    }


def test_gemm_first_call_bench_names_each_row_counts_kernel_and_the_grids_misses():
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "kernels"))
    import torch
    from gemm_first_call_bench import grid_misses, kernel_ranges, kernels_by_rows

    found = {1: "a", 2: "a", 3: "b", 4: "b", 5: "c", 6: "a"}
    assert kernel_ranges(found) == [(1, 2, "a"), (3, 4, "b"), (5, 5, "c"), (6, 6, "a")]
    assert grid_misses(found, 2) == {"c"} and grid_misses(found, 4) == {"c"}
    assert grid_misses(found, 3) == {"c"}  # M = 1, 3 and 6 meet a and b
    on_cpu = kernels_by_rows(torch.randn(8, 4), torch.randn(3, 4), [1, 5, 8])
    assert set(on_cpu) == {1, 5, 8} and all("mm" in names for names in on_cpu.values())


def test_gemm_first_call_bench_refuses_graph_capture_on_cpu():
    script = os.path.join(ROOT, "benchmark", "kernels", "gemm_first_call_bench.py")
    cmd = [sys.executable, script, "--device", "cpu", "--after-capture", "184"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "--after-capture needs CUDA graphs" in proc.stderr
