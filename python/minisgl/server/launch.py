"""`python -m minisgl`: start the scheduler, detokenizer and tokenizer processes, wait until
each is ready, then run the front end (HTTP, or the shell: `__main__` chooses) in this process.
Any child that dies, or a pipeline that hangs (the serving extension's watchdog,
`ext/serving/frontend.py`), takes the whole server down with exit code 1 (in-flight requests
get an error first); on exit every child is stopped. SIGTERM drains in-flight requests for up
to --shutdown-timeout seconds; those still running then end (with an error event, with the
serving extension's `http_server`). Children are titled `minisgl::NAME`; a `Reaper` removes
the sockets' directory even when this process is killed outright."""

from __future__ import annotations

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
from minisgl.extension import extensions
from minisgl.message import ApiFailMsg
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import ServerArgs, option_error
from minisgl.utils.options import OptionError
from minisgl.utils.procs import Reaper, die_with_parent, exit_with_parent, set_title, wait_ready

if TYPE_CHECKING:
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


def _send(addr: str, msg: Any) -> None:
    from minisgl.utils.zmq import ZmqPushQueue

    queue = ZmqPushQueue(addr, create=False)
    queue.put(msg)
    queue.close()  # lingers until the message is out


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The HTTP port's socket, bound before the model loads so that a taken port or a bad host
    fails at once. It listens only once uvicorn serves it: until then a client is refused at
    once, as before the bind, rather than left waiting in a backlog."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(
            f"cannot listen on {host}:{port} (--host, --port): {e.strerror}"
        ) from None
    return [sock]


def check_scale_out(args: ServerArgs, config: EngineConfig, nnodes: int = 1) -> None:
    """Clear errors, before any process starts, for a TP size or --max-model-len the model
    cannot take, or GPUs this machine does not have (--dp x --tp / `nnodes`)."""
    from minisgl.engine.engine import check_model
    from minisgl.utils.device import device_type

    gpus = args.dp * args.tp // nnodes
    if device_type(config.device) == "cuda":
        import torch

        found = torch.cuda.device_count()
        if gpus > found:
            per = f"--tp {args.tp} / --nnodes {nnodes}" if nnodes > 1 else f"--tp {args.tp}"
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
    """The server's processes on one machine: the --dp replicas' schedulers (and their TP
    ranks), the detokenizer and the tokenizer workers, started, watched and stopped. The
    serving extension's launcher (the `launcher` point) adds API processes and nodes."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.addrs = Addresses.make(args.num_tokenizer, args.dp, self.api_server_count)
        logger.info("sockets in %s", self.addrs.root)
        self.reaper = Reaper(self.addrs.root)
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.listeners: list[socket.socket] = []  # the port's sockets (then only this one's)
        self.stopping = False
        self.draining = False  # SIGTERM: the API processes finish their requests, then exit
        self.failure: str | None = None  # why the server stops with code 1 (a child died, hung)
        self._fail_lock = threading.Lock()
        self.info: dict[str, Any] = {}  # what the scheduler reported once ready (max_seq_len)
        # called (from a thread of its own) with the reason of a failure; None: SIGTERM self
        self.on_failure: Callable[[str], None] | None = None

    @property
    def api_server_count(self) -> int:
        return 1

    @property
    def ranks_here(self) -> int:
        """The TP ranks of one replica that run on this machine."""
        return self.args.tp

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
        if not self.args.shell:  # a taken port fails here, before a download
            self.listeners = self.listen()
        config = self.resolve_models()
        check_scale_out(self.args, config)  # before any process starts
        self.start_pipeline(config)
        threading.Thread(target=self._watch, daemon=True).start()

    def listen(self) -> list[socket.socket]:
        return listen_sockets(self.args.host, self.args.port)

    def resolve_models(self) -> EngineConfig:
        """The engine config with its model (and the extensions', e.g. a draft model)
        downloaded once, before any child starts."""
        from minisgl.models.weight import resolve_model_path

        args = self.args
        assert args.engine.model is not None  # __main__ resolves the default model
        path = resolve_model_path(args.engine.model)
        config = replace(args.engine, model=path)
        if (features := extensions().chat_features) is not None:  # the parsers' `auto`
            features.resolve_parsers(args, path)
        extras = args.scheduler.extras  # the models an extension's options name (a draft)
        for name, options in extras.items():
            if (resolve := getattr(options, "resolve_models", None)) is not None:
                extras[name] = resolve()
        return config

    def start_pipeline(self, config: EngineConfig) -> None:
        """Every replica's ranks, the detokenizer and the tokenizer workers, until all are
        ready (followers say hello first, then ready once built: rank 0 only after them)."""
        from minisgl.tokenizer.server import run_detokenizer, run_tokenizer

        args, a, model_path = self.args, self.addrs, config.model
        starters, followers = [], []
        for r in range(args.dp):
            starters.append(self._replica(config, r))
            followers += [self._follower(config, r, k) for k in range(1, self.ranks_here)]
        detok = (model_path, a.detokenizer, a.apis, a.schedulers)
        starters.append(self._spawn("detokenizer", run_detokenizer, *detok))
        dispatch = (config.page_size, args.dp_dispatch, args.dp_load_threshold)
        for i, addr in enumerate(a.tokenizers):
            tok = (model_path, args.chat_template, addr, a.schedulers, a.detokenizer, a.apis)
            starters.append(self._spawn(f"tokenizer_{i}", run_tokenizer, *tok, dispatch))
        for payload in wait_ready(*_split(starters + followers)):
            if payload:  # a replica's rank 0
                self.info["num_pages"] = self.info.get("num_pages", 0) + payload["num_pages"]
                self.info["max_seq_len"] = payload["max_seq_len"]
        wait_ready(*_split(followers))

    def _rendezvous(self, replica: int) -> Rendezvous:
        return rendezvous_file(self.addrs.root, f"tp-rendezvous-{replica}", replica * self.args.tp)

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

    def expected_exit(self, proc: Any) -> bool:
        """Whether `proc` ending is no failure (the serving extension's drained API processes)."""
        return False

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
            if self.expected_exit(dead):
                continue
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

    def run(self, front_end: Callable[[Launcher, Frontend], int]) -> int:
        """`front_end` (`serve_http`, or the shell) on this process's Frontend; its exit code."""
        from minisgl.server.frontend import Frontend

        a = self.addrs
        return front_end(self, Frontend(a.tokenizers, a.apis[0], a.schedulers))

    def drain(self) -> None:
        """SIGTERM reached this process (its requests drain in uvicorn)."""
        self.draining = True

    def stop(self) -> None:
        self.stopping = True
        for sock in self.listeners:
            sock.close()
        for p in self.procs:  # they ignore SIGTERM (see _child_main) and hold nothing to save
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        shutil.rmtree(self.addrs.root, ignore_errors=True)
        self.reaper.stop()


def launch_server(args: ServerArgs, front_end: Callable[[Launcher, Frontend], int]) -> int:
    """Start the children, run `front_end` (`serve_http`, or the shell) until it returns or
    SIGTERM, then stop the children; the exit code."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    hide_api_key()
    # The default SIGTERM action would kill this process at once and orphan the children.
    signal.signal(signal.SIGTERM, _on_sigterm)
    launcher = (extensions().launcher or Launcher)(args)
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
        code = launcher.run(front_end)
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


def plain_http_server(
    args: ServerArgs, app: Any, frontend: Frontend, on_shutdown: Callable[[], None] | None = None
) -> Any:
    """uvicorn as it comes: SIGTERM stops taking connections, waits up to --shutdown-timeout
    for the requests in progress, then cancels them. `on_shutdown` is called as it begins."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]  # float works
    )

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            await super().shutdown(sockets)

    return Server(config)


def http_server(
    args: ServerArgs,
    info: dict[str, Any],
    frontend: Frontend,
    on_shutdown: Callable[[], None] | None = None,
) -> Any:
    """The app under uvicorn, as one API process serves it (the `http_server` point's: the
    serving extension bounds the connections and ends a drain's requests with an error)."""
    from minisgl.server.api_server import create_app

    app = create_app(frontend, args, info["max_seq_len"], info)
    make = extensions().http_server or plain_http_server
    return make(args, app, frontend, on_shutdown)


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
