"""The offline benchmark script: its roofline model and a CPU smoke run on a tiny model."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))

from bench import GPU_PEAKS, roofline_tok_s, workload  # noqa: E402


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


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "result.jsonl"
    cmd = [
        sys.executable,
        os.path.join(ROOT, "benchmark", "offline", "bench.py"),
        "--tiny",
        "--device",
        "cpu",
        "--num-seqs",
        "3",
        "--max-input-len",
        "110",
        "--max-output-len",
        "104",
        "--json",
        str(out),
    ]
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["output_tokens"] == sum(workload(3, 110, 104)[1])
    assert result["tok_s"] > 0 and "tok/s" in proc.stdout
