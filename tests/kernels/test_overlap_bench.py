"""benchmark/kernels/overlap_bench.py (decode attention of one half-batch beside the other
half's GEMMs) on CPU: the smoke run, the interpreter's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="the smoke run is the CPU one")
def test_overlap_benchmark_smoke():
    """benchmark/kernels/overlap_bench.py --smoke checks each half's attention against the whole
    batch's, then prints every variant; an odd batch is refused naming the flag."""
    cmd = [sys.executable, os.path.join(ROOT, "benchmark", "kernels", "overlap_bench.py")]
    env_vars = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))
    proc = subprocess.run(
        [*cmd, "--smoke"], capture_output=True, text=True, timeout=120, env=env_vars
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    for name in ("attention", "gemms", "sequential", "halves", "overlapped"):
        assert f"  {name} " in proc.stdout, proc.stdout
    bad = subprocess.run([*cmd, "--batch", "3"], capture_output=True, text=True, env=env_vars)
    assert bad.returncode == 2 and "--batch 3" in bad.stderr
