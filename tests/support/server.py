"""Start `python -m minisgl` as a real subprocess on a tiny model, and stop it checking that no
process of it is left behind.

Children are found through /proc (parent pids), snapshotted once the server is healthy: an
orphan is re-parented away from the server, so it could not be found by parent pid afterwards.
A process is identified by (pid, start time), so a recycled pid is not taken for a survivor.

No orphans (issue 47): every server is tracked until it is seen stopped; `kill_tracked` (run by
tests/conftest.py at the session's end, on SIGTERM / SIGHUP, and here at interpreter exit)
kills whatever a test left running. Servers with the serving extension also get
--exit-with-parent, for a pytest killed outright (SIGKILL, os._exit), where nothing of it runs."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
T = TypeVar("T")


def make_tiny_model(path: str, context: int | None = None) -> str:
    """A random qwen3 checkpoint with the tiny test tokenizer and its chat template;
    `context`: its max_position_embeddings instead of the default."""
    from support.models import save_model
    from support.tokenizer import build_tiny_tokenizer

    save_model("qwen3", path)
    build_tiny_tokenizer(path)
    if context is not None:
        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        config["max_position_embeddings"] = context
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f)
    return path


def free_port() -> int:
    """A free TCP port on loopback, below the kernel's ephemeral range where there is room: a
    server binds it only later, and meanwhile its own TP ranks (gloo) and clients take
    ephemeral ports, which once took the one picked (EADDRINUSE at start-up)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    candidates = random.sample(range(10000, low), min(64, low - 10000)) if low > 11000 else []
    for port in [*candidates, 0]:  # 0: any port the kernel gives
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise AssertionError("no free port")


def wait_for(probe: Callable[[], T | None], timeout: float, what: str, interval: float = 0.1) -> T:
    """Poll `probe` until it returns something other than None (or False); fail after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value is not None and value is not False:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


# ---- processes ----------------------------------------------------------------------------
Proc = tuple[int, int]  # (pid, start time in clock ticks since boot)


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of a live process, None when gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()  # the name in (...) may contain spaces
    state, ppid, start = fields[0], int(fields[1]), int(fields[19])
    return None if state in ("Z", "X") else (state, ppid, start)


def descendants(pid: int) -> list[Proc]:
    """Every live process below `pid`, in pid order."""
    parents: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            parents.setdefault(st[1], []).append(int(name))
            starts[int(name)] = st[2]
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append((child, starts[child]))
            todo.append(child)
    return sorted(found)


def alive(procs: list[Proc]) -> list[Proc]:
    """Those of `procs` still running (same pid and same start time)."""
    return [(pid, start) for pid, start in procs if (st := _stat(pid)) and st[2] == start]


def title(pid: int) -> str:
    """What /proc/PID/cmdline says, as one string (a process's title, once it set one)."""
    return cmdline(pid).strip()


def _as_from_a_terminal(max_open_files: int | None) -> None:
    """In the server's process before it starts: Ctrl-C's default action, as a terminal gives it
    (a pytest run in the background of a script starts with SIGINT ignored, and an ignored
    signal is inherited: the server would ignore the Ctrl-C that tests send it); `max_open_files`:
    its RLIMIT_NOFILE (soft and hard)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    if max_open_files is not None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (max_open_files, max_open_files))


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# ---- no orphans ---------------------------------------------------------------------------
# pid -> (a process started in a session of its own, what else is known to be below it, the
# pid of the process that started it). Each pytest process (an xdist worker too) kills only its
# own: a forked child inherits the dict and the atexit hook. A plain dict, no lock:
# `kill_tracked` runs in a signal handler, which must not wait for a lock the interrupted code
# holds.
_TRACKED: dict[int, tuple[subprocess.Popen[bytes], Callable[[], list[Proc]], int]] = {}
REAPER_GRACE_S = 3.0  # for the server's reaper (its own session) to clean up and leave


def track(proc: subprocess.Popen[bytes], known: Callable[[], list[Proc]] = list) -> None:
    """Have `kill_tracked` stop `proc`, started with start_new_session=True (its session, and
    so its process group, are its pid), with all below it, unless `untrack`ed first."""
    _TRACKED[proc.pid] = (proc, known, os.getpid())


def untrack(proc: subprocess.Popen[bytes]) -> None:
    _TRACKED.pop(proc.pid, None)


def kill_tracked() -> list[str]:
    """SIGKILL every tracked process's group (a server and its workers) at once, then, after
    REAPER_GRACE_S at most, anything still alive below them (the reaper first removes the
    server's temp directory: it has a session of its own and leaves when the server dies).
    The command lines of the processes that were running."""
    victims, below = [], []
    tracked = list(_TRACKED.items())
    ours = [(pid, proc, known) for pid, (proc, known, owner) in tracked if owner == os.getpid()]
    for pid, proc, known in ours:
        if proc.poll() is None:  # not reaped: the pid, and so the group id, is still ours
            victims.append(cmdline(pid).strip() or str(pid))
            below += descendants(pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        below += known()
    deadline = time.monotonic() + REAPER_GRACE_S
    while alive(below) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid, _ in alive(below):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid, proc, _ in ours:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)  # no zombie, no "still running" warning
        _TRACKED.pop(pid, None)
    return victims


atexit.register(kill_tracked)  # an ending interpreter (after pytest's own clean-up) kills the rest


# ---- the server ---------------------------------------------------------------------------
def with_extensions(env: dict[str, str]) -> bool:
    """Whether a server started with `env` loads minisgl/ext (as `minisgl.extension` decides)."""
    off = env.get("MINISGL_DISABLE_EXTENSIONS", "").strip().lower() in ("1", "true", "yes", "on")
    return os.path.isdir(os.path.join(REPO, "python", "minisgl", "ext")) and not off


class Server:
    """One `python -m minisgl` process; output goes to a log file (a pipe could fill up)."""

    def __init__(
        self,
        model: str | None,
        *args: str,
        log_path: str,
        extra_env: dict[str, str] | None = None,
        max_open_files: int | None = None,
        exit_with_parent: bool = True,
    ) -> None:
        """`model` None: no --model flag (the embedded default model). `extra_env`: variables
        added to the server's environment; `max_open_files`: its RLIMIT_NOFILE (soft and hard);
        `exit_with_parent` False: no --exit-with-parent (tests of the clean-up without it)."""
        self.model = model
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        extra_env = extra_env or {}
        env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"), PYTHONUNBUFFERED="1")
        env.update(extra_env)
        cmd = [sys.executable, "-m", "minisgl", "--port", str(self.port)]
        # should this pytest be killed outright (no clean-up of its runs), the server goes too
        # (the serving extension's flag: the core alone would refuse it)
        cmd += ["--exit-with-parent"] if exit_with_parent and with_extensions(env) else []
        cmd += ["--model", model] if model is not None else []
        self._log = open(log_path, "wb")  # closed by stop() or kill_all()
        # A session of its own: a signal to its group is what a terminal's Ctrl-C does.
        self.proc = subprocess.Popen(
            [*cmd, *args],
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: _as_from_a_terminal(max_open_files),
        )
        self.children: list[Proc] = []
        track(self.proc, lambda: self.children)  # until stop() or kill_all() has seen it end
        self.expect_code = 0  # what `run_server` expects at the end (a test may kill it)
        self.headers: dict[str, str] = {}  # what /stats needs when the server wants an API key
        key = args[args.index("--api-key") + 1] if "--api-key" in args else None
        key = key or extra_env.get("MINISGL_API_KEY")
        if key:
            self.headers["authorization"] = f"Bearer {key}"

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def _healthy(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"server exited with code {self.proc.returncode} during start-up:\n{self.log()}"
            )
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        try:
            wait_for(self._healthy, timeout, "GET /health", interval=0.05)
        except AssertionError as e:
            if self.proc.poll() is None:
                self.kill_all()
                raise AssertionError(f"{e}; server log:\n{self.log()}") from None
            raise
        self.children = descendants(self.proc.pid)

    def child_pid(self, name: str) -> int:
        """Pid of the child titled `minisgl::NAME` ("scheduler_0", "detokenizer",
        "tokenizer_0", "reaper", ...)."""
        titled = [pid for pid, _ in descendants(self.proc.pid) if title(pid) == f"minisgl::{name}"]
        assert len(titled) == 1, f"{len(titled)} processes titled minisgl::{name}"
        return titled[0]

    def get_json(self, path: str) -> Any:
        request = urllib.request.Request(f"{self.url}{path}", headers=self.headers)
        with urllib.request.urlopen(request, timeout=10) as r:
            return json.loads(r.read())

    def stats(self) -> dict[str, int]:
        return self.get_json("/stats")

    def wait_idle(self, timeout: float = 30.0) -> dict[str, int]:
        """The scheduler snapshot once nothing runs, waits or is in flight."""

        def idle() -> dict[str, int] | None:
            s = self.stats()
            quiet = s["running"] == 0 and s["waiting"] == 0 and s["in_flight"] == 0
            return s if quiet and s["total_pages"] > 0 else None

        return wait_for(idle, timeout, "the scheduler to go idle")

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"server did not exit within {timeout:.0f} s; log:\n{self.log()}"
            ) from None

    def assert_no_survivors(self, grace: float = 5.0) -> None:
        # multiprocessing's resource tracker leaves when it reads EOF from the dead parent
        deadline = time.monotonic() + grace
        while (left := alive(self.children)) and time.monotonic() < deadline:
            time.sleep(0.05)
        if left:
            detail = "\n".join(f"  {pid}: {cmdline(pid)}" for pid, _ in left)
            for pid, _ in left:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            raise AssertionError(f"processes left behind by the server:\n{detail}\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, group: bool = False) -> int:
        """Send `sig` (to the whole process group when `group`, like a terminal's Ctrl-C), wait
        for the exit, check no child survived; the exit code."""
        if self.proc.poll() is None:
            if group:
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        try:
            code = self.wait_exit()
        except AssertionError:
            self.kill_all()
            raise
        finally:
            self._log.close()
        untrack(self.proc)  # its group is gone; assert_no_survivors kills the rest
        self.assert_no_survivors()
        return code

    def kill_all(self) -> None:
        """Last resort: SIGKILL the server and everything below it."""
        procs = [*descendants(self.proc.pid), *self.children]
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        for pid, _ in alive(procs):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()
        untrack(self.proc)
        self._log.close()


@contextlib.contextmanager
def run_server(
    model: str | None,
    *args: str,
    log_path: str,
    stop_signal: int = signal.SIGTERM,
    group: bool = False,
    extra_env: dict[str, str] | None = None,
    max_open_files: int | None = None,
) -> Iterator[Server]:
    """A healthy server for the `with` block; afterwards it must stop on `stop_signal` within
    10 s, with exit code 0 (or `server.expect_code`) and no process left behind."""
    files = max_open_files
    server = Server(model, *args, log_path=log_path, extra_env=extra_env, max_open_files=files)
    try:
        server.wait_ready()
        yield server
    except BaseException:
        server.kill_all()
        raise
    code = server.stop(stop_signal, group=group)
    expected = server.expect_code
    assert code == expected, (
        f"server exited with code {code} on signal {stop_signal}:\n{server.log()}"
    )


# the plain tiny server that test modules share (`shared_server(*TINY_SERVER)`, tests/conftest.py)
TINY_SERVER = ("--page-size", "4", "--served-model-name", "tiny")
# the fuzzers' (test_fuzz, test_schemathesis): a short context, so every accepted request is short
SHORT_SERVER = ("--page-size", "4", "--max-model-len", "64")


class SharedServers:
    """Tiny servers shared by every test module of the session that asks for the same arguments
    (issue 47: a start costs seconds of imports in five processes): started at first use, stopped
    at the session's end with `run_server`'s checks (exit code 0, no process left behind).
    Only for modules whose tests neither stop, kill nor drain the server nor depend on what other
    modules sent it (a log read from an offset, not from the start)."""

    def __init__(self, factory: Any) -> None:
        self.factory = factory  # pytest's tmp_path_factory
        self.servers: dict[tuple[Any, ...], Server] = {}

    def get(
        self,
        *args: str,
        extra_env: dict[str, str] | None = None,
        script: tuple[str, str] | None = None,
    ) -> Server:
        """`script`: (the answer, the answer after a tool's result) of a scripted tiny model
        (support/scripted.py) instead of the random one."""
        key = (args, tuple(sorted((extra_env or {}).items())), script)
        if key not in self.servers:
            path = str(self.factory.mktemp("models") / "tiny")
            if script is None:
                model = make_tiny_model(path)
            else:
                from support.scripted import build_scripted_model

                model = build_scripted_model(path, *script)
            log = str(self.factory.mktemp("logs") / "shared.log")
            server = Server(model, *args, log_path=log, extra_env=extra_env)
            try:
                server.wait_ready()
            except BaseException:
                server.kill_all()  # as run_server does: nothing of a failed start stays
                raise
            self.servers[key] = server
        return self.servers[key]

    def stop_all(self) -> None:
        """Stop every shared server, as stop_servers does."""
        servers = list(self.servers.values())
        self.servers.clear()
        stop_servers(servers)


def stop_servers(servers: list[Server]) -> None:
    """Stop every server (all of them, whatever one of them does); AssertionError naming
    those that did not exit with 0 (or their `expect_code`) or left a process behind."""
    failures = []
    for server in servers:
        try:
            code = server.stop()
        except AssertionError as e:
            failures.append(str(e))
            continue
        if code != server.expect_code:
            failures.append(f"server exited with code {code}:\n{server.log()}")
    assert not failures, "\n".join(failures)


@contextlib.contextmanager
def run_servers(*servers: Server) -> Iterator[tuple[Server, ...]]:
    """`run_server` for servers started together (their starts overlap: a start is mostly
    imports in five processes): healthy for the `with` block, afterwards each stopped and
    checked (exit code 0, or its `expect_code`; no process left behind)."""
    try:
        for server in servers:
            server.wait_ready()
        yield servers
    except BaseException:
        for server in servers:
            server.kill_all()
        raise
    stop_servers(list(servers))


@contextlib.contextmanager
def tiny_server(factory: Any, *args: str, **options: Any) -> Iterator[Server]:
    """`run_server` on a new tiny random model (`factory`: pytest's tmp_path_factory), its log
    in a temporary folder: the usual module-scoped server of a test file."""
    model = make_tiny_model(str(factory.mktemp("models") / "tiny"))
    log = str(factory.mktemp("logs") / "server.log")
    with run_server(model, *args, log_path=log, **options) as server:
        yield server
