"""`python -m minisgl`: start the scheduler, detokenizer and tokenizer processes, wait until
each is ready, then run the front end (HTTP, or the shell: `__main__` chooses) in this process.
Any child that dies, or a pipeline that hangs (the watchdog, `Frontend`), takes the whole server
down with exit code 1 (in-flight requests get an error first); on exit every child is stopped.
SIGTERM drains in-flight requests for up to --shutdown-timeout seconds; those still running
then end with an error. Children are titled `minisgl::NAME`; a `Reaper` removes the sockets'
directory even when this process is killed outright."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.distributed import Rendezvous, rendezvous_file
from minisgl.engine.config import EngineConfig
from minisgl.message import ApiFailMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, option_error
from minisgl.utils.options import OptionError
from minisgl.utils.procs import Reaper, die_with_parent, exit_with_parent, set_title, wait_ready

if TYPE_CHECKING:
    from minisgl.server.connections import ConnectionLimits
    from minisgl.server.frontend import Frontend

logger = logging.getLogger("minisgl")


@dataclass
class Addresses:
    root: str  # a private temp directory (mode 0700): the ipc sockets, the TP rendezvous files
    schedulers: list[str]  # rank 0 of each --dp replica
    detokenizer: str
    apis: list[str]  # each API process's (--api-server-count), by rank
    tokenizers: list[str]

    @staticmethod
    def make(num_tokenizer: int, dp: int = 1, api_servers: int = 1) -> Addresses:
        root = tempfile.mkdtemp(prefix="minisgl-")
        ipc = lambda name: f"ipc://{os.path.join(root, name)}"  # noqa: E731
        tokenizers = [ipc(f"tokenizer{i}") for i in range(num_tokenizer)]
        schedulers = [ipc("scheduler" if r == 0 else f"scheduler{r}") for r in range(dp)]
        apis = [ipc("api" if k == 0 else f"api{k}") for k in range(api_servers)]
        return Addresses(root, schedulers, ipc("detokenizer"), apis, tokenizers)


class Terminated(BaseException):
    """SIGTERM arrived: unwind to `launch_server`, whose `finally` stops the children."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


DEATH_GRACE_S = 1.5  # after a failure: time for clients (on a loaded machine) to get their errors and see /health 503
STOP_OTHER_NODES_S = 3.0  # rank 0's wait, on a clean stop, for the other nodes' ranks to stop
CUT_MARGIN_S = 0.5  # the drain's requests still running end this long before it runs out


Started = tuple[Any, Any]  # a child's end of its `ready` pipe (the parent's side), its process


def _split(started: list[Started]) -> tuple[list[Any], list[Any]]:
    return [conn for conn, _ in started], [proc for _, proc in started]


def _follower_main(
    config: EngineConfig,
    sched_config: SchedulerConfig,
    rank: int,
    tp: int,
    meet: Rendezvous,
    sharing: int,
    title: str,
    ready: Any,
) -> None:
    from minisgl.scheduler.io import run_follower

    run_follower(config, sched_config, rank, tp, meet, ready, sharing, title)


def _api_main(
    args: ServerArgs, info: dict[str, Any], rank: int, addrs: Addresses, sock: Any, ready: Any
) -> None:
    """API process `rank` > 0 of --api-server-count: the app on the socket of the port that
    rank 0 (the main process) opened for it; a failure it sees (its watchdog) goes to rank 0."""
    from minisgl.server.frontend import Frontend

    def report(reason: str) -> None:
        _send(addrs.apis[0], ApiFailMsg(reason))

    frontend = Frontend(
        addrs.tokenizers,
        addrs.apis[rank],
        args.watchdog_timeout,
        report,
        addrs.schedulers,
        api_rank=rank,
        api_addrs=addrs.apis,
    )
    server = http_server(args, info, frontend)
    ready.send(("ready", None))
    server.run(sockets=[sock])  # uvicorn drains on SIGTERM / SIGINT, as rank 0 does


def _send(addr: str, msg: Any) -> None:
    from minisgl.utils.zmq import ZmqPushQueue

    queue = ZmqPushQueue(addr, create=False)
    queue.put(msg)
    queue.close()  # lingers until the message is out


def listen_sockets(host: str, port: int, count: int) -> list[socket.socket]:
    """The HTTP port's sockets, bound before the model loads so that a taken port or a bad host
    fails at once. One API process's socket listens only once uvicorn serves it: until then a
    client is refused at once, as before the bind, rather than left waiting in a backlog.
    Several (--api-server-count) get SO_REUSEPORT and listen now: the kernel spreads new
    connections evenly over the listening ones (one socket that all accept from would let
    whichever process wakes first take a whole burst). A plain bind first makes sure that no
    other server holds the port: SO_REUSEPORT alone would share it with one of the same user."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    def bound(reuse_port: bool) -> socket.socket:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            sock.bind((host, port))
        except OSError as e:
            sock.close()
            error = f"cannot listen on {host}:{port} (--host, --port): {e.strerror}"
            raise RuntimeError(error) from None
        return sock

    if count == 1:
        return [bound(reuse_port=False)]
    bound(reuse_port=False).close()
    socks = [bound(reuse_port=True) for _ in range(count)]
    for sock in socks:  # all in the kernel's spread from now on, whichever process serves first
        sock.listen()
    return socks


def check_scale_out(args: ServerArgs, config: EngineConfig) -> None:
    """Clear errors, before any process starts, for a TP size or --max-model-len the model
    cannot take, or GPUs this machine does not have (--dp x --tp / --nnodes)."""
    from minisgl.engine.engine import check_model
    from minisgl.utils.device import device_type

    gpus = args.dp * args.tp_per_node
    if device_type(config.device) == "cuda":
        import torch

        found = torch.cuda.device_count()
        if gpus > found:
            per = (
                f"--tp {args.tp} / --nnodes {args.nnodes}" if args.nnodes > 1 else f"--tp {args.tp}"
            )
            raise ValueError(
                f"--dp {args.dp} x {per} needs {gpus} GPUs on this machine, found {found}"
            )
    check_model(config, args.tp, gpus)


LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"


def _child_main(name: str, log_level: str, target: Any, *args: Any) -> None:
    # A terminal's Ctrl-C (or systemd's SIGTERM) signals the whole process group; only the
    # parent acts on it, draining requests first and then stopping the children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    set_title(name)
    # a spawned interpreter starts without logging: --log-level applies here too
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)
    target(*args)


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.addrs = Addresses.make(args.num_tokenizer, args.dp, args.api_server_count)
        logger.info("sockets in %s", self.addrs.root)
        self.reaper = Reaper(self.addrs.root)
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.api_procs: list[Any] = []  # of those, the API processes other than this one
        self.listeners: list[socket.socket] = []  # the port's sockets (then only rank 0's)
        self.stopping = False
        self.draining = False  # SIGTERM: the API processes finish their requests, then exit
        self.failure: str | None = None  # why the server stops with code 1 (a child died, hung)
        self._fail_lock = threading.Lock()
        self.info: dict[str, Any] = {}  # what the scheduler reported once ready (max_seq_len)
        # called (from a thread of its own) with the reason of a failure; None: SIGTERM self
        self.on_failure: Callable[[str], None] | None = None

    def _spawn(self, name: str, target: Any, *target_args: Any) -> Started:
        """Start `target(*target_args, ready)` in a child titled `minisgl::NAME`; the parent's
        end of the `ready` pipe, and the process."""
        parent, child = self.ctx.Pipe(duplex=False)
        level = self.args.log_level
        proc = self.ctx.Process(
            target=_child_main,
            args=(name, level, target, *target_args, child),
            name=name,
            daemon=True,
        )
        proc.start()
        assert proc.pid is not None  # started
        self.reaper.watch(proc.pid)
        logger.info("%s process started (pid %d)", name, proc.pid)
        self.procs.append(proc)
        return parent, proc

    def start(self) -> None:
        from minisgl.models.weight import resolve_model_path
        from minisgl.tokenizer.server import run_detokenizer, run_tokenizer

        args, a = self.args, self.addrs
        if args.node_rank == 0 and not args.shell:  # a taken port fails here, before a download
            self.listeners = listen_sockets(args.host, args.port, args.api_server_count)
        assert args.engine.model is not None  # __main__ resolves the default model
        model_path = resolve_model_path(args.engine.model)  # download once, before the children
        config = replace(args.engine, model=model_path)
        if (draft := args.scheduler.speculative_draft_model_path) is not None:  # the same for it
            path = resolve_model_path(draft, "speculative_draft_model_path")
            args.scheduler = replace(args.scheduler, speculative_draft_model_path=path)
        check_scale_out(args, config)  # before any process starts
        per_node, first = args.tp_per_node, args.node_rank * args.tp_per_node
        if args.node_rank > 0:  # scheduler ranks only: no front end on this node
            followers = [self._follower(config, 0, k) for k in range(first, first + per_node)]
            wait_ready(*_split(followers))  # hello
            wait_ready(*_split(followers))  # built, in the group
            return
        starters, followers = [], []
        for r in range(args.dp):
            starters.append(self._replica(config, r))
            followers += [self._follower(config, r, k) for k in range(1, per_node)]
        sched = a.schedulers
        detok = (model_path, a.detokenizer, a.apis, sched)
        starters.append(self._spawn("detokenizer", run_detokenizer, *detok))
        dispatch = (config.page_size, args.dp_dispatch, args.dp_load_threshold)
        for i, addr in enumerate(a.tokenizers):
            tok = (model_path, args.chat_template, addr, sched, a.detokenizer, a.apis, dispatch)
            starters.append(self._spawn(f"tokenizer_{i}", run_tokenizer, *tok))
        # followers say hello first, then ready once built (rank 0 is ready only after them)
        for payload in wait_ready(*_split(starters + followers)):
            if payload:  # a replica's rank 0
                self.info["num_pages"] = self.info.get("num_pages", 0) + payload["num_pages"]
                self.info["max_seq_len"] = payload["max_seq_len"]
        wait_ready(*_split(followers))
        if len(self.listeners) > 1:
            apis = [
                self._spawn(f"api_server_{k}", _api_main, args, self.info, k, a, self.listeners[k])
                for k in range(1, args.api_server_count)
            ]
            self.api_procs = [proc for _, proc in apis]
            wait_ready(*_split(apis))
            for sock in self.listeners[1:]:  # each is its process's now: when that one closes
                sock.close()  # it (drain) or dies, the kernel sends its connections elsewhere
            del self.listeners[1:]
        threading.Thread(target=self._watch, daemon=True).start()

    def _rendezvous(self, replica: int) -> Rendezvous:
        args = self.args
        if args.nnodes > 1:  # rank 0's node hosts the TCP store; GPU 0 is the node's first rank
            shift = -args.node_rank * args.tp_per_node
            return Rendezvous("", args.dist_init_addr, args.dist_timeout, shift)
        return rendezvous_file(self.addrs.root, f"tp-rendezvous-{replica}", replica * args.tp)

    def _name(self, replica: int, rank: int) -> str:
        return f"scheduler_{rank}" if self.args.dp == 1 else f"dp{replica}_scheduler_{rank}"

    def _replica(self, config: EngineConfig, replica: int) -> Started:
        from minisgl.scheduler.io import run_scheduler_process

        args = self.args
        io = (self.addrs.schedulers[replica], self.addrs.detokenizer, (replica, args.dp))
        meet = self._rendezvous(replica)
        warm_up = not args.skip_server_warmup
        entry = (run_scheduler_process, config, args.scheduler, args.tp, meet, *io, warm_up)
        return self._spawn(self._name(replica, 0), *entry)

    def _follower(self, config: EngineConfig, replica: int, rank: int) -> Started:
        args = self.args
        name, meet = self._name(replica, rank), self._rendezvous(replica)
        entry = (config, args.scheduler, rank, args.tp, meet, args.dp, name)
        return self._spawn(name, _follower_main, *entry)

    def _watch(self) -> None:
        """Stop the server when any child dies, instead of hanging its clients."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: p for p in self.procs}
        while sentinels:
            ready = wait(list(sentinels))
            if self.stopping:
                return
            dead = sentinels.pop(ready[0])
            dead.join(timeout=1)  # the exit code is known only once it is reaped
            if self.draining and dead in self.api_procs:
                continue  # it drained its requests (`stop` may have reaped it: no exit code)
            self.fail(f"{dead.name} process died (exit code {dead.exitcode})")
            return

    def fail(self, reason: str) -> None:
        """A child died or the pipeline hung: stop the server, which exits with code 1 (the
        first failure only; called from a thread other than the event loop's)."""
        with self._fail_lock:
            if self.stopping or self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; shutting down", reason)
        for addr in self.addrs.apis[1:]:  # the other API processes end their requests too
            # on threads: a dead one's socket would hold `close` for its linger
            threading.Thread(target=_send, args=(addr, ApiFailMsg(reason)), daemon=True).start()
        if self.on_failure is not None:
            self.on_failure(reason)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def follow(self) -> int:
        """A node other than rank 0's: wait until a scheduler rank ends (rank 0 stopped them,
        or is gone); 0 when every one ended cleanly."""
        from multiprocessing.connection import wait

        print(f"minisgl: node {self.args.node_rank} serving its TP ranks", flush=True)
        wait([p.sentinel for p in self.procs])
        for p in self.procs:
            p.join(timeout=5)
        if any(p.exitcode != 0 for p in self.procs):
            self.failure = "; ".join(
                f"{p.name} process ended with exit code {p.exitcode} (rank 0 gone?)"
                for p in self.procs
                if p.exitcode != 0
            )
        return 0

    def _stop_other_nodes(self) -> None:
        """With --nnodes > 1, rank 0 tells the other ranks to stop (its ExitMsg to them), so
        that the other nodes exit 0; killed instead, it would leave them to find it gone."""
        from minisgl.message import ExitMsg

        rank0 = self.procs[0]
        if not rank0.is_alive():
            return
        _send(self.addrs.schedulers[0], ExitMsg())
        rank0.join(timeout=STOP_OTHER_NODES_S)

    def drain(self) -> None:
        """SIGTERM reached this process: the other API processes drain their requests too."""
        self.draining = True
        for proc in self.api_procs:
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.draining and not self.failure:  # they got the same time as this process
            deadline = time.monotonic() + self.args.shutdown_timeout + DEATH_GRACE_S
            for proc in self.api_procs:
                proc.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stopping = True
        for sock in self.listeners:
            sock.close()
        if self.args.nnodes > 1 and self.args.node_rank == 0 and self.procs and not self.failure:
            self._stop_other_nodes()
        for p in self.procs:  # they ignore SIGTERM (see _child_main) and hold nothing to save
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.addrs.root, ignore_errors=True)
        self.reaper.stop()


# The server's default: with Python's 700 10 10, the API process's full collections (20-37 ms
# on an H100) each held back every stream of an all-at-once burst (docs/benchmarks.md, session 20).
SERVER_GC_THRESHOLD = (700, 10, 1000)


def export_gc_settings(args: ServerArgs) -> None:
    """The collector's settings, for every server process to read once ready (spawned children
    copy the environment): the flags, else what the caller's environment says, else the
    server's default thresholds."""
    if args.gc_warning_threshold_secs > 0:
        os.environ["MINISGL_GC_WARNING_THRESHOLD_SECS"] = str(args.gc_warning_threshold_secs)
    if args.gc_threshold is not None:
        os.environ["MINISGL_GC_THRESHOLD"] = ",".join(map(str, args.gc_threshold))
    elif not os.environ.get("MINISGL_GC_THRESHOLD", "").strip():
        os.environ["MINISGL_GC_THRESHOLD"] = ",".join(map(str, SERVER_GC_THRESHOLD))


def launch_server(args: ServerArgs, front_end: Callable[[Launcher, Frontend], int]) -> int:
    """Start the children, run `front_end` (`serve_http`, or the shell) until it returns or
    SIGTERM, then stop the children; the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    hide_api_key()
    export_gc_settings(args)
    # The default SIGTERM action would kill this process at once and orphan the children.
    signal.signal(signal.SIGTERM, _on_sigterm)
    launcher = Launcher(args)
    try:
        if args.exit_with_parent:  # its SIGTERM then unwinds here, through launcher.stop()
            exit_with_parent()
        try:
            launcher.start()
        except OptionError as e:  # found only now, e.g. a --model the hub cannot provide
            print(f"minisgl: {option_error(e)}", file=sys.stderr)
            return 2
        except (RuntimeError, ValueError) as e:
            print(f"minisgl: {e}", file=sys.stderr)
            return 1
        if args.node_rank > 0:
            code = launcher.follow()
        else:
            from minisgl.server.frontend import Frontend

            addrs, timeout = launcher.addrs, args.watchdog_timeout
            frontend = Frontend(
                addrs.tokenizers,
                addrs.apis[0],
                timeout,
                launcher.fail,
                addrs.schedulers,
                api_addrs=addrs.apis,
            )
            code = front_end(launcher, frontend)
    except (Terminated, KeyboardInterrupt):  # a requested stop, or a failure (Launcher.fail)
        code = 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # let nothing interrupt the clean-up
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
    if launcher.failure:
        print(f"minisgl: {launcher.failure}", file=sys.stderr)
        return 1
    return code


class _CutShort(logging.Filter):
    """uvicorn logs a request that the server's exit cancelled (the drain ran out, or a
    failure's forced exit) as an application error, with a CancelledError traceback: no bug,
    so one line instead. With no drain (--shutdown-timeout 0) it also says, as an error, that
    it cancels 0 tasks: dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cancel %s running task") and record.args == (0,):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError) and str(record.msg).startswith("Exception in"):
            record.msg, record.args = "a request was cut short: the server is stopping", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


FORCED_EXIT_WAIT_S = 1.0  # a forced exit's wait for the requests whose connections it closed


async def _end_forced(server: Any, limits: ConnectionLimits) -> None:
    """A failure's exit (`serve_http`: its requests got their errors already) skips uvicorn's
    drain and the app's lifespan shutdown: the tasks left would be cancelled as the loop
    closes, the lifespan's logging a CancelledError traceback. Close every connection (the
    requests still there see their client gone and end), wait a moment for them, and end the
    lifespan."""
    for conn in list(server.server_state.connections):
        limits.close(conn)
    if server.server_state.tasks:
        await asyncio.wait(set(server.server_state.tasks), timeout=FORCED_EXIT_WAIT_S)
    with contextlib.suppress(asyncio.TimeoutError):  # a hung shutdown handler
        await asyncio.wait_for(server.lifespan.shutdown(), FORCED_EXIT_WAIT_S)


def make_server(
    config: Any,
    frontend: Frontend,
    limits: ConnectionLimits,
    drain_s: float,
    on_shutdown: Callable[[], None] | None = None,
) -> Any:
    """uvicorn's server, whose drain (SIGTERM) ends the requests still running with the error
    event (or a 503) just before `drain_s` (--shutdown-timeout) runs out, not a bare close,
    and drops then those whose body has not come. `on_shutdown` is called as the drain begins.
    Its exits log no traceback (see `_end_forced`, `_CutShort`)."""
    import uvicorn

    errors = logging.getLogger("uvicorn.error")  # after uvicorn.Config set its logging up
    if not any(isinstance(f, _CutShort) for f in errors.filters):
        errors.addFilter(_CutShort())

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            limits.quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)

        def cut(self, reason: str) -> None:
            """The drain's end: the requests still running end with `reason`, those whose
            head or body has not come are dropped."""
            frontend.fail(reason)
            limits.close_waiting(self.server_state.connections)

        async def shutdown(self, sockets: Any = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            reason = f"server shut down before the request finished ({drain_s:g} s drain)"
            timer = None
            if drain_s <= CUT_MARGIN_S:
                self.cut(reason)  # uvicorn's 0.1 s pause before cutting lets the errors out
            else:
                timer = asyncio.get_running_loop().call_later(
                    drain_s - CUT_MARGIN_S, self.cut, reason
                )
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()
            if self.force_exit:
                await _end_forced(self, limits)

    return Server(config)


def hide_api_key() -> None:
    """Mask --api-key's value in this process's command line (`ps`, /proc/PID/cmdline). Other
    users could read it there until now: MINISGL_API_KEY is the way to keep it private."""
    argv = list(sys.orig_argv)
    hidden = False
    for i, arg in enumerate(argv):
        if arg == "--api-key" and i + 1 < len(argv):
            argv[i + 1], hidden = "***", True
        elif arg.startswith("--api-key="):
            argv[i], hidden = "--api-key=***", True
    if hidden:
        import setproctitle

        setproctitle.setproctitle(" ".join(argv))


def http_server(
    args: ServerArgs,
    info: dict[str, Any],
    frontend: Frontend,
    on_shutdown: Callable[[], None] | None = None,
) -> Any:
    """The app under uvicorn, as one API process serves it (each of --api-server-count gets
    its share of --max-connections)."""
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.connections import ConnectionLimits, connection_budget

    app = create_app(frontend, args, info["max_seq_len"], info)
    share = -(-args.max_connections // frontend.api_count)
    max_connections, backlog = connection_budget(share)
    limits = ConnectionLimits(max_connections, args.timeout_keep_alive)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=limits.protocol(),
        backlog=backlog,
        # no limit_concurrency: its 503 refuses /health too; the Gate limits requests instead
        timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # float works
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
    )
    return make_server(config, frontend, limits, args.shutdown_timeout, on_shutdown)


def serve_http(launcher: Launcher, frontend: Frontend) -> int:
    args = launcher.args
    server = http_server(args, launcher.info, frontend, launcher.drain)

    def on_failure(reason: str) -> None:
        frontend.fail_threadsafe(reason)  # in-flight requests end with an error, /health 503
        time.sleep(DEATH_GRACE_S)
        server.should_exit = server.force_exit = True  # nothing left to drain

    launcher.on_failure = on_failure
    print(f"minisgl: serving {args.engine.model} on http://{args.host}:{args.port}", flush=True)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again: that ends
    # here as Terminated / KeyboardInterrupt, caught by launch_server.
    server.run(sockets=launcher.listeners[:1] or None)
    return 0
