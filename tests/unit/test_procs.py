"""utils/procs.wait_ready: a child that dies before its ready message gives a clear error (its
name and exit code), never the pipe's EOFError traceback; freeze_startup_heap.

The children are forked from one forkserver that has imported minisgl and its extensions
(`CHILDREN`): a fresh interpreter per case paid those imports (about 2 s) each time."""

from __future__ import annotations

import multiprocessing as mp
import os
import subprocess

import pytest
import setproctitle

from minisgl.utils.procs import wait_ready


def die_at_once(conn) -> None:
    conn.close()
    os._exit(3)  # as an import error in a worker would, before any message


def report_ready(conn) -> None:
    conn.send(("ready", 7))


# Each child is a fresh process whose modules are already imported; the server forks every
# child of this module (a server process's gc state starts as a fresh interpreter's would, its
# start-up heap then holding torch and the extensions, as a real server process's does).
CHILDREN = mp.get_context("forkserver")
CHILDREN.set_forkserver_preload(["minisgl.utils.procs", "minisgl.ext"])


def start(target, name: str):
    """A child given the sending end of a pipe; (its receiving end, the process)."""
    parent, child = CHILDREN.Pipe(duplex=False)
    proc = CHILDREN.Process(target=target, args=(child,), name=name)
    proc.start()
    child.close()
    return parent, proc


def test_child_dying_before_ready_names_it_and_its_exit_code():
    parent, proc = start(die_at_once, "scheduler_0")
    with pytest.raises(
        RuntimeError, match=r"scheduler_0 process exited during start-up \(exit code 3\)"
    ):
        wait_ready([parent], [proc])


def test_ready_payload_is_returned():
    parent, proc = start(report_ready, "detokenizer")
    assert wait_ready([parent], [proc]) == [7]
    proc.join()


def exec_code(code: str, env: dict[str, str], stdout: str, stderr: str) -> None:
    """In a child: run `code` as `python -c` would, in `env`, its output into two files."""
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    setproctitle.getproctitle()  # set up before the environment moves: it finds argv from it
    os.environ.clear()
    os.environ.update(env)
    exec(compile(code, "<child>", "exec"), {"__name__": "__main__"})


def run_code(code: str, env: dict[str, str], tmp_path) -> subprocess.CompletedProcess:
    """`python -c code` in `env` as a forked child: its exit code (1 for an exception, whose
    traceback is in its stderr), stdout and stderr."""
    stdout, stderr = str(tmp_path / "stdout"), str(tmp_path / "stderr")
    proc = CHILDREN.Process(target=exec_code, args=(code, env, stdout, stderr))
    proc.start()
    proc.join()
    with open(stdout) as out, open(stderr) as err:
        return subprocess.CompletedProcess(code, proc.exitcode, out.read(), err.read())


FREEZE_CHILD = """
import gc, sys
sys.path.insert(0, {python!r})
from minisgl.utils.procs import freeze_startup_heap
cycle = []
cycle.append(cycle)  # start-up garbage: collected before the freeze, never frozen
del cycle
frozen = freeze_startup_heap()
print(frozen, gc.get_freeze_count(), len(gc.get_objects(generation=2)))
"""


@pytest.mark.parametrize("disabled", [False, True])
def test_freeze_startup_heap(disabled, tmp_path):
    """A serving process's start-up heap leaves the collector's full passes (they then walk
    only what serving creates); MINISGL_DISABLE_GC_FREEZE=1 keeps it there."""
    python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    env = {**os.environ, "MINISGL_DISABLE_GC_FREEZE": "1" if disabled else "0"}
    code = FREEZE_CHILD.format(python=os.path.abspath(python))
    out = run_code(code, env, tmp_path)
    frozen, count, oldest = map(int, out.stdout.split())
    if disabled:
        assert frozen == count == 0 and oldest > 1000
    else:
        assert frozen == count > 1000 and oldest < 100


WATCH_CHILD = """
import gc, logging, sys
sys.path.insert(0, {python!r})
logging.basicConfig(level="WARNING", format="%(message)s")
from minisgl.utils.procs import freeze_startup_heap, set_title
if {titled}:
    set_title("tokenizer_0")
freeze_startup_heap()  # its own collection is start-up's: never logged
cycle = []
cycle.append(cycle)
del cycle
gc.collect()  # serving's, longer than any threshold above 0
"""


@pytest.mark.parametrize("threshold", ["", "0", "1e-9", "1e-12", "1000", "-1", "x"])
def test_long_garbage_collections_are_logged_once_ready(threshold, tmp_path):
    """MINISGL_GC_WARNING_THRESHOLD_SECS (what --gc-warning-threshold-secs sets for every
    server process): a warning naming the process for each collection over it, after the
    process is ready; unset or 0: none; a bad value: a clear error."""
    python = os.path.join(os.path.dirname(__file__), "..", "..", "python")
    env = {**os.environ, "MINISGL_GC_WARNING_THRESHOLD_SECS": threshold}
    code = WATCH_CHILD.format(python=os.path.abspath(python), titled=threshold != "1e-12")
    out = run_code(code, env, tmp_path)
    warnings = [line for line in out.stderr.splitlines() if "garbage collection took" in line]
    if threshold in ("-1", "x"):
        assert out.returncode != 0 and "MINISGL_GC_WARNING_THRESHOLD_SECS" in out.stderr
        return
    assert out.returncode == 0, out.stderr
    if threshold not in ("1e-9", "1e-12"):
        assert warnings == []
        return
    if threshold == "1e-12":  # a process without a worker's title: the main process
        assert warnings and all("main process (pid" in w for w in warnings)
        return
    assert all("minisgl::tokenizer_0 (pid" in w for w in warnings)  # later small ones too
    assert any("generation-2 " in w and "1 objects collected" in w for w in warnings)
    assert "--gc-warning-threshold-secs 1e-09" in warnings[0]


def test_gc_warning_flag_is_checked():
    from minisgl.ext.serving.options import serving_options
    from minisgl.server.args import parse_args

    parsed = serving_options(parse_args(["--gc-warning-threshold-secs", "0.05"]))
    assert parsed.gc_warning_threshold_secs == 0.05
    with pytest.raises(SystemExit):
        parse_args(["--gc-warning-threshold-secs", "-1"])


THRESHOLD_CHILD = """
import gc, logging, sys
sys.path.insert(0, {python!r})
logging.basicConfig(level="INFO", format="%(message)s")
from minisgl.utils.procs import freeze_startup_heap
gc.set_threshold(700, 10, 10)  # Python's defaults, whatever this interpreter was given
before = gc.get_threshold()
freeze_startup_heap()
print(*before, *gc.get_threshold())
"""


@pytest.mark.parametrize(
    "value, counts",
    [("", (700, 10, 10)), ("700,10,1000", (700, 10, 1000)), (" 50000 ", (50000, 10, 10)),
     ("0", (0, 10, 10)), ("1,2,3,4", None), ("-1", None), ("x", None), ("1,,2", None)],
)  # fmt: skip
def test_gc_thresholds_apply_once_ready(value, counts, tmp_path):
    """MINISGL_GC_THRESHOLD (what --gc-threshold sets for every server process): a ready
    process gives its counts to gc.set_threshold and says so; unset: Python's stay; a bad
    value: a clear error naming the variable."""
    python = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "python"))
    env = {**os.environ, "MINISGL_GC_THRESHOLD": value}
    code = THRESHOLD_CHILD.format(python=python)
    out = run_code(code, env, tmp_path)
    if counts is None:
        assert out.returncode != 0 and "MINISGL_GC_THRESHOLD" in out.stderr, out.stderr
        return
    assert out.returncode == 0, out.stderr
    assert tuple(map(int, out.stdout.split())) == (700, 10, 10, *counts)
    said = "garbage-collection thresholds" in out.stderr
    assert said == bool(value), out.stderr


def test_gc_threshold_flag_is_checked():
    from minisgl.ext.serving.options import serving_options
    from minisgl.server.args import parse_args

    def parsed(*argv: str) -> list[int] | None:
        return serving_options(parse_args(list(argv))).gc_threshold

    assert parsed() is None
    assert parsed("--gc-threshold", "700", "10", "1000") == [700, 10, 1000]
    assert parsed("--gc-threshold", "20000") == [20000]
    for bad in (["1", "2", "3", "4"], ["-1"], ["x"], []):
        with pytest.raises(SystemExit):
            parse_args(["--gc-threshold", *bad])


@pytest.mark.parametrize(
    "flag, environ, exported",
    [([], None, "700,10,1000"), ([], "700,10,10", "700,10,10"), ([], " ", "700,10,1000"),
     (["--gc-threshold", "2000", "20"], "700,10,10", "2000,20")],
)  # fmt: skip
def test_server_gc_threshold_defaults_to_the_measured_one(monkeypatch, flag, environ, exported):
    """The server's processes get 700 10 1000 unless the flag or MINISGL_GC_THRESHOLD says
    otherwise; the flag wins over the variable."""
    from minisgl.ext.serving.collector import export_gc_settings
    from minisgl.server.args import parse_args

    if environ is None:
        monkeypatch.delenv("MINISGL_GC_THRESHOLD", raising=False)
    else:
        monkeypatch.setenv("MINISGL_GC_THRESHOLD", environ)
    export_gc_settings(parse_args(flag))
    assert os.environ["MINISGL_GC_THRESHOLD"] == exported


def test_api_server_freezes_what_its_tokenizer_load_brings(tmp_path, monkeypatch):
    """The API server loads its tokenizer on first use (/v1/models' vocab_size, /tokenize),
    which imports transformers into a process whose heap is already frozen: the load freezes
    again, so every later full collection does not walk those modules."""
    import asyncio
    import gc

    from minisgl.ext.serving import api_tokenizer
    from minisgl.ext.serving.model_card import model_cards
    from minisgl.server import api_server
    from minisgl.server.args import parse_args
    from support.server import make_tiny_model

    model = make_tiny_model(str(tmp_path / "tiny"))
    api = api_server.ApiServer(None, parse_args(["--model", model, "--device", "cpu"]), 128)  # type: ignore[arg-type]
    freezes: list[int] = []
    real = api_tokenizer.freeze_startup_heap
    monkeypatch.setattr(api_tokenizer, "freeze_startup_heap", lambda: freezes.append(real()))
    gc.collect()
    before = gc.get_freeze_count()
    try:
        card = asyncio.run(model_cards(api))["data"][0]
        assert card["vocab_size"] > 0 and gc.get_freeze_count() > before
        asyncio.run(model_cards(api))  # loaded once: no second freeze
        # (counted by the calls: the frozen count itself falls when a frozen object dies,
        # which other tests' leftovers did on CI)
        assert len(freezes) == 1
    finally:
        gc.unfreeze()
