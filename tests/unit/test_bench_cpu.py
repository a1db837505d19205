"""benchmark/offline/bench_cpu.py: its report (medians, ratios) and a minisgl-only smoke run on
a tiny GGUF (llama-cpp-python is not in the test environment)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "benchmark", "offline", "bench_cpu.py")
sys.path.insert(0, os.path.dirname(SCRIPT))

from bench_cpu import random_prompt, report  # noqa: E402

from support.cache import link_kernels  # noqa: E402
from support.gguf_files import write_gguf  # noqa: E402


def test_report_takes_medians_and_the_ratio(capsys):
    rows = {
        "minisgl": [{"decode_tok_s": d, "prefill_tok_s": 300.0} for d in (40.0, 50.0, 45.0)],
        "llama.cpp": [{"decode_tok_s": d, "prefill_tok_s": 150.0} for d in (90.0, 80.0, 100.0)],
    }
    out = report(rows, None)
    assert out["minisgl_decode_tok_s"] == 45.0 and out["llama_cpp_decode_tok_s"] == 90.0
    assert out["ratio_decode"] == 0.5 and out["ratio_prefill"] == 2.0
    assert "ratio" in capsys.readouterr().out


def test_prompts_are_seeded_and_inside_the_vocabulary():
    a, b = random_prompt(64, 3, 512), random_prompt(64, 3, 512)
    assert a == b and all(128 <= t <= 384 for t in a)


@pytest.mark.parametrize(
    "extra",
    [
        [],
        [
            "--streams",
            "2",
            "--temperature",
            "1",
            "--top-p",
            "0.9",
            "--top-k",
            "5",
            "--context",
            "24",
        ],
    ],
    ids=["greedy", "sampled-streams"],
)
def test_smoke_on_a_tiny_gguf(tmp_path, extra):
    path = str(tmp_path / "tiny.gguf")
    write_gguf("llama", path, with_tokenizer=True)
    out_json = str(tmp_path / "out.jsonl")
    env = {**os.environ, "MINISGL_CACHE_DIR": link_kernels(tmp_path / "cache")}  # built kernels
    cmd = [sys.executable, SCRIPT, "--model", path, "--decode-tokens", "16"]
    cmd += ["--prompt-tokens", "16", "--repeats", "1", "--json", out_json, *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    if extra:  # several streams: minisgl alone
        assert "2 streams: minisgl alone" in run.stdout and "ratio" not in run.stdout
    elif "llama-cpp-python not found" not in run.stdout:  # installed here: both engines ran
        assert "ratio" in run.stdout
    line = json.loads(open(out_json).read())
    assert line["bench"] == "bench_cpu" and line["minisgl_decode_tok_s"] > 0
    assert line["prompt_tokens"] == 16 and line["threads"] >= 1
    assert line["streams"] == (2 if extra else 1) and line["top_k"] == (5 if extra else 0)
    assert line["context"] == (24 if extra else 0)


@pytest.mark.parametrize(
    "flags, says",
    [
        (["--repeats", "0"], "--repeats must be at least 1"),
        (["--streams", "0"], "--streams must be at least 1"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--context", "-1"], "--context must be at least 0"),
    ],
)
def test_bad_counts_name_the_flag(flags, says):
    run = subprocess.run(
        [sys.executable, SCRIPT, *flags], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and says in run.stderr
