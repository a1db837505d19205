"""No orphans (issue 47): a pytest run that is stopped (SIGTERM, Ctrl-C) leaves no server
process behind, and `python -m minisgl --exit-with-parent` stops, children and all, when its
parent dies outright (SIGKILL). Each test kills whatever it started, even when it fails."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from support.server import (
    REPO,
    START_TIMEOUT_S,
    Proc,
    alive,
    cmdline,
    descendants,
    free_port,
    make_tiny_model,
    wait_for,
)

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
GONE_WITHIN_S = 10.0  # the bound: after the stop, nothing of the run is left by then
# `python -c` that runs pytest with Ctrl-C's default handler (the rest of argv: pytest's)
SIGINT_DEFAULT = (
    "import signal, sys, pytest; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.exit(pytest.main(sys.argv[1:]))"
)

# A test for the inner pytest: a real server (the flags), its port in a marker file once
# it serves, then it sleeps until stopped.
INNER_TEST = """
import json, os, time
from support.server import Server

def test_serves_then_sleeps():
    server = Server(
        os.environ["ORPHAN_MODEL"], "--api-server-count", "2", "--watchdog-timeout", "3",
        log_path=os.environ["ORPHAN_LOG"], exit_with_parent=os.environ["ORPHAN_FLAG"] == "1",
    )
    server.wait_ready()
    with open(os.environ["ORPHAN_MARKER"] + ".tmp", "w") as f:
        json.dump({"port": server.port, "pid": server.proc.pid}, f)
    os.rename(os.environ["ORPHAN_MARKER"] + ".tmp", os.environ["ORPHAN_MARKER"])
    time.sleep(600)
"""

# A parent that starts a server with --exit-with-parent, says its pid, then sleeps until killed.
PARENT = """
import os, subprocess, sys, time
model, port, log = sys.argv[1:]
cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", port, "--exit-with-parent",
       "--api-server-count", "2", "--watchdog-timeout", "3"]
env = dict(os.environ, PYTHONPATH=os.path.join(os.getcwd(), "python"), PYTHONUNBUFFERED="1")
with open(log, "wb") as out:
    server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, start_new_session=True)
print(server.pid, flush=True)
time.sleep(600)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


def serving(port: int) -> list[int]:
    """Pids of the `python -m minisgl` processes on `port`, whoever started them."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            line = cmdline(int(name))
            if "minisgl" in line and re.search(rf"--port {port}( |$)", line):
                found.append(int(name))
    return found


def socket_dir(log_path: str) -> str:
    """The server's private temp directory, as its log names it."""
    with open(log_path, errors="replace") as f:
        match = re.search(r"sockets in (\S+)", f.read())
    assert match, f"no socket directory in the server log:\n{Path(log_path).read_text()}"
    return match.group(1)


def assert_all_gone(procs: list[Proc], port: int, directory: str, log_path: str) -> None:
    """Within GONE_WITHIN_S: none of `procs`, no server on `port`, no temp directory left."""

    def gone() -> bool:
        return not alive(procs) and not serving(port) and not os.path.exists(directory)

    try:
        wait_for(gone, GONE_WITHIN_S, "every process of the stopped run to end")
    except AssertionError as e:
        left = "\n".join(f"  {pid}: {cmdline(pid)}" for pid, _ in alive(procs))
        extra = [f"  {pid}: {cmdline(pid)}" for pid in serving(port)]
        log = Path(log_path).read_text(errors="replace")
        raise AssertionError(
            f"{e}\nleft:\n{left}\n{chr(10).join(extra)}\ntemp directory there: "
            f"{os.path.exists(directory)}\nserver log:\n{log}"
        ) from None


@contextlib.contextmanager
def cleanup(leader: subprocess.Popen[bytes]) -> Iterator[list[Proc]]:
    """Whatever happens: SIGKILL `leader`'s session (it has one of its own) and every process
    put in the yielded list, so that a failing test leaves nothing running either."""
    procs: list[Proc] = []
    try:
        yield procs
    finally:
        procs += descendants(leader.pid)  # before it dies: its children would be re-parented
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if leader.poll() is None:
                os.killpg(leader.pid, signal.SIGKILL)
        for pid, _ in alive(procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        leader.wait()


@pytest.mark.parametrize(
    ("sig", "flag", "code", "workers"),
    [
        (signal.SIGTERM, True, -signal.SIGTERM, 0),  # as the issue saw it (the flag on servers)
        (signal.SIGTERM, False, -signal.SIGTERM, 0),  # conftest's handler alone
        (signal.SIGINT, False, 2, 0),  # KeyboardInterrupt: the session's finalizer alone
        (signal.SIGTERM, True, -signal.SIGTERM, 2),  # README's run: xdist workers (-n 2)
    ],
    ids=["sigterm", "sigterm-without-flag", "sigint-without-flag", "sigterm-xdist"],
)
def test_stopped_pytest_leaves_no_server(
    model_dir: str, tmp_path: Path, sig: int, flag: bool, code: int, workers: int
) -> None:
    (tmp_path / "test_inner.py").write_text(INNER_TEST)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    marker, log, server_log = tmp_path / "ready.json", tmp_path / "pytest.log", tmp_path / "s.log"
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "tests"), ORPHAN_MODEL=model_dir)
    env |= {"ORPHAN_LOG": str(server_log), "ORPHAN_MARKER": str(marker)}
    env["ORPHAN_FLAG"] = "1" if flag else "0"
    # tests/conftest.py as a plugin: its hooks are what is tested; a basetemp of its own
    # SIGINT handled as in a terminal even when this pytest runs as a background job of a
    # script (`nohup pytest &`), which starts with SIGINT ignored: an ignored signal is inherited
    # through exec, and Python then leaves it ignored (no KeyboardInterrupt)
    cmd = [sys.executable, "-c", SIGINT_DEFAULT, "-p", "conftest", "-p", "no:cacheprovider", "-q"]
    cmd += ["-c", str(tmp_path / "pytest.ini"), "--basetemp", str(tmp_path / "inner")]
    cmd += ["-n", str(workers)] if workers else []
    with open(log, "wb") as out:
        inner = subprocess.Popen(
            [*cmd, str(tmp_path / "test_inner.py")],
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # for the clean-up only: the signal goes to pytest alone
        )
    with cleanup(inner) as procs:

        def ready() -> bool:
            if inner.poll() is not None:
                raise AssertionError(f"inner pytest ended early:\n{log.read_text()}")
            return marker.exists()

        wait_for(ready, START_TIMEOUT_S + 60, "the inner test's server", interval=0.05)
        port = json.loads(marker.read_text())["port"]
        procs += descendants(inner.pid)  # the server, its workers, its reaper
        assert serving(port), f"no server on port {port}: {procs}"
        directory = socket_dir(str(server_log))
        inner.send_signal(sig)
        # a bound against a hang, not a speed: under load pytest's exit took over 30 s
        assert inner.wait(timeout=120) == code, log.read_text()
        assert_all_gone(procs, port, directory, str(server_log))
    if sig == signal.SIGINT:  # the finalizer said what it killed
        assert "killed 1 server(s) left running by the tests" in log.read_text()


def test_server_exits_when_its_parent_is_killed(model_dir: str, tmp_path: Path) -> None:
    port, server_log = free_port(), str(tmp_path / "server.log")
    (tmp_path / "parent.py").write_text(PARENT)
    args = [sys.executable, str(tmp_path / "parent.py"), model_dir, str(port), server_log]
    parent = subprocess.Popen(
        args, cwd=REPO, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
    )
    with cleanup(parent) as procs:
        assert parent.stdout is not None
        server = int(parent.stdout.readline())

        def healthy() -> bool:
            import urllib.request

            if not os.path.exists(f"/proc/{server}"):
                raise AssertionError(f"server exited:\n{Path(server_log).read_text()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    return r.status == 200
            except OSError:
                return False

        wait_for(healthy, START_TIMEOUT_S, "GET /health", interval=0.05)
        procs += descendants(parent.pid)  # the server (own session), its workers, its reaper
        assert len(procs) >= 6, procs  # server, scheduler, detokenizer, tokenizer, api, reaper
        directory = socket_dir(server_log)
        parent.kill()
        parent.wait()
        assert_all_gone(procs, port, directory, server_log)
    assert "parent process" in Path(server_log).read_text()  # it said why it stopped


# A process that watches its parent (as --exit-with-parent does, but with SIGTERM's default
# action: it just dies), started from a thread of its parent that ends at once.
WATCHER = """
import sys, time
from minisgl.ext.serving.parent import exit_with_parent
exit_with_parent(kernel_signal=sys.argv[1] == "1")
print("watching", flush=True)
time.sleep(120)
"""
THREAD_PARENT = """
import os, subprocess, sys, threading, time
started = []

def start():
    started.append(subprocess.Popen(sys.argv[2:]))
    while "watching" not in open(sys.argv[1]).read():  # its prctl is set: now this thread ends
        time.sleep(0.05)

thread = threading.Thread(target=start)
thread.start()
thread.join()  # PR_SET_PDEATHSIG fires as this thread ends: the watcher must not stop
print(started[0].pid, flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("kernel_signal", [True, False], ids=["prctl", "poll-only"])
def test_parent_watch(tmp_path: Path, kernel_signal: bool) -> None:
    """The watch itself: the end of the parent's starting thread is no parent death; the
    parent's SIGKILL is, seen through the kernel's signal or by the portable poll alone."""
    (tmp_path / "watcher.py").write_text(WATCHER)
    (tmp_path / "parent.py").write_text(THREAD_PARENT)
    out = tmp_path / "watcher.out"
    out.write_text("")
    watcher_cmd = f"{sys.executable} {tmp_path / 'watcher.py'} {int(kernel_signal)}"
    shell = f"exec {watcher_cmd} > {out}"
    args = [sys.executable, str(tmp_path / "parent.py"), str(out), "sh", "-c", shell]
    parent = subprocess.Popen(args, stdout=subprocess.PIPE, start_new_session=True)
    with cleanup(parent) as procs:
        assert parent.stdout is not None
        watcher = int(parent.stdout.readline())  # once it watches and the thread ended
        procs += [p for p in descendants(parent.pid) if p[0] == watcher]
        assert procs, "the watcher is not running"
        time.sleep(1.5)  # three polls, and any signal the thread's end sent
        assert alive(procs), "the watcher stopped while its parent lives"
        parent.kill()
        parent.wait()
        wait_for(lambda: not alive(procs), 5, "the watcher to stop after its parent")
