"""The shell's start-up (issue 51): what its own process imports (no HTTP server, no torch), a
GGUF converted at the first start of the CLI (it needs torch and transformers together, which
the launcher's processes otherwise keep apart), the launcher's children starting with the
garbage collector off until ready and transformers without its torch side, and
benchmark/offline/bench_startup.py. No timings are asserted: the bench reports them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from support.cache import link_kernels
from support.server import REPO, make_tiny_model

# `python -m minisgl ARGS...` run as runpy does it, writing the modules this (the shell's)
# process imported into the file argv[1] at exit; its spawned children re-import
# minisgl.__main__, not this script, so the list is the shell's process's alone
MODULES_SCRIPT = """
import atexit, runpy, sys
out = sys.argv[1]
atexit.register(lambda: open(out, "w").write("\\n".join(sorted(sys.modules))))
sys.argv = ["minisgl", *sys.argv[2:]]
runpy.run_module("minisgl", run_name="__main__", alter_sys=True)
"""


def run_cli(
    script: str, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`script` with `args` in a fresh interpreter, "/exit" on its standard input."""
    env = dict(env or os.environ, PYTHONPATH=os.path.join(REPO, "python"), TERM="dumb")
    cmd = [sys.executable, "-c", script, *args]
    return subprocess.run(
        cmd, input="/exit\n", env=env, capture_output=True, text=True, timeout=180, cwd=REPO
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("startup_model")))


def test_the_shell_process_imports_no_http_server_nor_torch(model_dir: str, tmp_path) -> None:
    out = str(tmp_path / "modules.txt")
    done = run_cli(MODULES_SCRIPT, out, "--model", model_dir, "--shell", "--page-size", "4")
    assert done.returncode == 0, done.stderr
    assert "/exit (or Ctrl-D) quits." in done.stdout
    with open(out) as f:
        modules = set(f.read().split())
    assert "prompt_toolkit" in modules and "minisgl.shell" in modules  # it did run the shell
    heavy = {"fastapi", "uvicorn", "torch", "minisgl.server.api_server"}
    assert not heavy & modules, heavy & modules


@pytest.mark.ext
def test_a_gguf_converts_at_the_first_start_of_the_cli(tmp_path) -> None:
    from support.gguf_files import write_gguf

    path = str(tmp_path / "tiny.gguf")
    write_gguf("llama", path, with_tokenizer=True)
    cache = tmp_path / "cache"
    env = dict(os.environ, MINISGL_CACHE_DIR=link_kernels(cache))  # the run's built kernels
    script = "import runpy; runpy.run_module('minisgl', run_name='__main__', alter_sys=True)"
    args = ("--model", path, "--shell", "--page-size", "4", "--max-model-len", "64")
    done = run_cli(script, *args, env=env)
    assert done.returncode == 0, done.stderr
    assert "minisgl: converted tiny.gguf" in done.stderr, done.stderr
    assert "/exit (or Ctrl-D) quits." in done.stdout
    (entry,) = os.listdir(cache / "gguf")
    assert os.path.isfile(cache / "gguf" / entry / "config.json")


# A child as the launcher starts one (`_child_main`), its target reporting what it runs with;
# then ready (`freeze_startup_heap`), as every child says it once built.
CHILD_SCRIPT = """
import gc, sys
from minisgl.server.launch import _child_main
from minisgl.utils.procs import freeze_startup_heap

class Ready:
    def send(self, msg): pass

def target(ready):
    from transformers.utils import is_torch_available
    starting = (gc.isenabled(), is_torch_available(), "torch" in sys.modules)
    import torch  # still importable: the scheduler's engine needs it
    freeze_startup_heap()
    print(starting, gc.isenabled(), torch.ones(1).item())

_child_main("test", "warning", target, (), Ready())
"""


def test_children_start_without_the_collector_and_transformers_torch() -> None:
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    done = subprocess.run(
        [sys.executable, "-c", CHILD_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == "(False, False, False) True 1.0", done.stdout


def test_bench_startup_reports_each_start(model_dir: str, tmp_path) -> None:
    rows = str(tmp_path / "rows.jsonl")
    bench = os.path.join(REPO, "benchmark", "offline", "bench_startup.py")
    cmd = [sys.executable, bench, "--model", model_dir, "--no-cold", "--warm", "1"]
    cache = link_kernels(tmp_path / "cache")  # a warm start: the run's kernels are built
    cmd += ["--json", rows, "--cache-dir", cache, "--", "--page-size", "4"]
    cmd += ["--max-model-len", "64"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "warm median: prompt" in done.stdout, done.stdout
    with open(rows) as f:
        (row,) = [json.loads(line) for line in f]
    assert row["kind"] == "warm" and row["prompt_s"] > 0 and row["answer_s"] > 0
    assert row["answer"] and "[error]" not in row["answer"], row
    assert "scheduler_0" in row["cpu_s"] and len(row["load"]) == 3
    assert row["command"].startswith("python benchmark/offline/bench_startup.py --model")
    assert row["commit"] is None or len(row["commit"]) >= 7


def test_bench_startup_keeps_inductors_cache_in_its_own(tmp_path) -> None:
    """A cold start compiles as on a fresh machine: inductor's cache inside the start's cache
    (which a cold start removes), not /tmp's."""
    sys.path.insert(0, os.path.join(REPO, "benchmark", "offline"))
    try:
        import bench_startup
    finally:
        sys.path.pop(0)
    env = bench_startup.start_env(str(tmp_path / "cache"))
    assert env["MINISGL_CACHE_DIR"] == str(tmp_path / "cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "cache" / "inductor")
