"""`python -m minisgl`: start the scheduler, detokenizer and tokenizer processes, wait until
each is ready, run the front end (HTTP, or the shell), stop every child on exit."""

# A child that dies takes the whole server down with exit code 1 (in-flight requests get an
# error first); SIGTERM drains in-flight requests for up to --shutdown-timeout seconds.
# Children are titled `minisgl::NAME` and die with this process (Linux). The serving
# extension's launcher (the `launcher` point) adds --dp replicas, API processes, nodes, the
# watchdog and a reaper for a launcher killed outright.

from __future__ import annotations

import functools
import gc
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

from minisgl.distributed import rendezvous_file
from minisgl.engine.config import EngineConfig, check_model, config_model_path
from minisgl.extension import extensions
from minisgl.models.hf import transformers_without_torch
from minisgl.server.args import ServerArgs, option_error
from minisgl.utils import procs
from minisgl.utils.options import OptionError
from minisgl.utils.procs import die_with_parent, set_title, wait_ready

if TYPE_CHECKING:
    from minisgl.server.frontend import Frontend

logger = logging.getLogger("minisgl")
LOG_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
DEATH_GRACE_S = 1.5  # after a failure: time for clients to get their errors and see /health 503
Started = tuple[Any, Any]  # a child's `ready` pipe (the parent's end), its process


@dataclass
class Addresses:
    root: str  # a private temp directory (mode 0700): the ipc sockets, the TP rendezvous files
    schedulers: list[str]  # TP rank 0's (one per replica with the serving extension's --dp)
    detokenizer: str
    apis: list[str]  # the API process's (one per --api-server-count)
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


def _split(started: list[Started]) -> tuple[list[Any], list[Any]]:
    return [conn for conn, _ in started], [proc for _, proc in started]


def _child_main(
    name: str, log_level: str, target: Any, args: Any, ready: Any, **kwargs: Any
) -> None:
    # A terminal's Ctrl-C (or systemd's SIGTERM) signals the whole process group; only the
    # parent acts on it, draining requests first and then stopping the children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    set_title(name)
    logging.basicConfig(level=log_level.upper(), format=LOG_FORMAT)  # a spawned child has none
    # Start-up makes ~10^6 objects that live as long as the process (imports, the model): the
    # collector's full passes over them cost a scheduler ~0.3 s; `freeze_startup_heap` turns
    # it back on once ready (issue 51). And no child runs a transformers model (the engine has
    # its own): none pays for transformers' torch side (~1 s); torch stays importable.
    gc.disable()
    transformers_without_torch()
    target(*args, ready, **kwargs)


class Launcher:
    """The server's child processes on one machine: started, watched and stopped."""

    def __init__(self, args: ServerArgs, addrs: Addresses | None = None) -> None:
        self.args = args
        self.addrs = addrs or Addresses.make(args.num_tokenizer)
        logger.info("sockets in %s", self.addrs.root)
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        # the HTTP port's sockets, bound early by the serving extension's launcher (none: uvicorn
        # binds the port itself)
        self.listeners: list[socket.socket] = []
        self.stopping = False
        self.failure: str | None = None  # why the server stops with code 1
        self._fail_lock = threading.Lock()
        self.info: dict[str, Any] = {}  # what the schedulers reported once ready (max_seq_len)
        # called (on a thread of its own) with the reason of a failure; None: SIGTERM self
        self.on_failure: Callable[[str], None] | None = None
        # the serving extension's launcher sets these: its tokenizer worker (None: the core's)
        # and the API processes' reply queues, made in the children (None: this process's)
        self.tokenizer_worker: Callable[..., Any] | None = None
        self.api_queue: Callable[[], Any] | None = None

    def _spawn(self, name: str, target: Any, *target_args: Any, **kwargs: Any) -> Started:
        """Start `target(*target_args, ready, **kwargs)` in a child titled `minisgl::NAME`."""
        args = (name, self.args.log_level, target, target_args)
        parent, proc = procs.spawn(self.ctx, name, _child_main, *args, **kwargs)
        logger.info("%s process started (pid %d)", name, proc.pid)
        self.procs.append(proc)
        return parent, proc

    def start(self) -> None:
        config = self.resolve_models()
        self.check(config)
        self.start_pipeline(config)
        threading.Thread(target=self._watch, daemon=True).start()

    def check(self, config: EngineConfig) -> None:
        """Before any process starts: a --tp or --max-model-len the model or GPUs cannot take."""
        check_model(config, self.args.tp)

    def resolve_models(self) -> EngineConfig:
        """The engine config, its model (and a draft model's) downloaded before any child starts."""
        from minisgl.models.weight import resolve_model_path

        args = self.args
        assert args.engine.model is not None  # __main__ resolves the default model
        path = resolve_model_path(args.engine.model)
        extras = args.scheduler.extras
        for name, options in extras.items():
            if (resolve := getattr(options, "resolve_models", None)) is not None:
                extras[name] = resolve()
        # this process runs no model: transformers without torch (issue 47), but only now,
        # after a GGUF's conversion, which needs both
        transformers_without_torch()
        return replace(args.engine, model=path)

    def start_pipeline(self, config: EngineConfig) -> None:
        """The schedulers, the detokenizer and the tokenizer workers, until all are ready (TP
        ranks > 0 say hello first, then ready once built: rank 0 only after them)."""
        from minisgl.tokenizer.detokenize import run_detokenizer
        from minisgl.tokenizer.server import TokenizerWorker, run_tokenizer
        from minisgl.utils.zmq import ZmqPushQueue

        args, a, model_path = self.args, self.addrs, config_model_path(config)
        starters, followers = self.start_schedulers(config)
        api_queue = self.api_queue or functools.partial(ZmqPushQueue, a.apis[0], create=False)
        detok = (model_path, a.detokenizer, api_queue, a.schedulers)
        starters.append(self._spawn("detokenizer", run_detokenizer, *detok))
        worker = self.tokenizer_worker or TokenizerWorker
        for i, addr in enumerate(a.tokenizers):
            tok = (model_path, addr, a.schedulers, a.detokenizer, api_queue)
            starters.append(self._spawn(f"tokenizer_{i}", run_tokenizer, *tok, worker=worker))
        # only the front end reads the parsers' `auto`: a tokenizer loads while the children start
        if (features := extensions().chat_features) is not None:
            features.resolve_parsers(args, model_path)
        self.preload_front_end()
        for payload in wait_ready(*_split(starters + followers)):
            if payload:  # a TP rank 0 (one per --dp replica)
                self.info["num_pages"] = self.info.get("num_pages", 0) + payload["num_pages"]
                self.info["max_seq_len"] = payload["max_seq_len"]
        wait_ready(*_split(followers))

    def preload_front_end(self) -> None:
        """While the children start (the serving extension's: import the front end's modules)."""

    def start_schedulers(self, config: EngineConfig) -> tuple[list[Started], list[Started]]:
        """TP rank 0 (ready with the engine's sizes) and the other ranks, which meet at a file."""
        from minisgl.scheduler.io import run_scheduler_process, start_followers

        args, a, meet = self.args, self.addrs, rendezvous_file(self.addrs.root)
        # warm up: the `warm_up` point's, where one is (ext/serving's launcher reads its flag)
        io = (a.schedulers[0], a.detokenizer, (0, 1), True)
        rank0 = self._spawn(
            "scheduler_0", run_scheduler_process, config, args.scheduler, args.tp, meet, *io
        )
        return [rank0], start_followers(self._spawn, config, args.scheduler, args.tp, meet)

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
            if not self.expected_exit(dead):
                self.fail(f"{dead.name} process died (exit code {dead.exitcode})")
                return

    def fail(self, reason: str) -> None:
        """A child died: stop the server, exit code 1 (the first failure; off the event loop)."""
        with self._fail_lock:
            if self.stopping or self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; shutting down", reason)
        if self.on_failure is not None:
            self.on_failure(reason)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def run(self, front_end: Callable[[Launcher, Frontend], int]) -> int:
        """`front_end` (`serve_http`, or the shell) on this process's Frontend; its exit code."""
        from minisgl.server.frontend import Frontend

        return front_end(self, Frontend(self.addrs.tokenizers, self.addrs.apis[0]))

    def stop(self) -> None:
        self.stopping = True
        for sock in self.listeners:
            sock.close()
        # killed: they ignore SIGTERM (see _child_main) and hold nothing to save
        procs.stop_children(self.procs)
        shutil.rmtree(self.addrs.root, ignore_errors=True)


def launch_server(args: ServerArgs, front_end: Callable[[Launcher, Frontend], int]) -> int:
    """Start the children, run `front_end` until it returns or SIGTERM, stop them; exit code."""
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    # The default SIGTERM action would kill this process at once and orphan the children.
    signal.signal(signal.SIGTERM, _on_sigterm)
    launcher = (extensions().launcher or Launcher)(args)
    try:
        try:  # a SIGTERM from here on (ext/serving's --exit-with-parent) unwinds to the stop
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


def http_server(args: ServerArgs, info: dict[str, Any], frontend: Frontend) -> Any:
    """The app under uvicorn, or the `http_server` point's server."""
    # plain uvicorn: SIGTERM stops taking connections, waits up to --shutdown-timeout for the
    # requests in progress, then cancels them
    import uvicorn

    from minisgl.server.api_server import create_app

    app = create_app(frontend, args, info)
    if (make := extensions().http_server) is not None:
        return make(args, app, frontend)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level)
    # --shutdown-timeout (uvicorn types it int; a float works)
    config.timeout_graceful_shutdown = args.shutdown_timeout  # type: ignore[assignment]
    return uvicorn.Server(config)


def serve_http(launcher: Launcher, frontend: Frontend) -> int:
    args = launcher.args
    server = http_server(args, launcher.info, frontend)

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
