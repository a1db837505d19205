"""`python -m minisgl`: start the scheduler, detokenizer and tokenizer processes, wait until
each is ready, then run the front end (HTTP, or the shell: `__main__` chooses) in this process. Any child that dies takes the
whole server down with a non-zero exit (in-flight requests get an error first); on exit every
child is stopped. SIGTERM drains in-flight requests for up to --shutdown-timeout seconds."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.server.args import ServerArgs
from minisgl.utils.procs import die_with_parent, wait_ready

if TYPE_CHECKING:
    from minisgl.server.frontend import Frontend

logger = logging.getLogger("minisgl")


@dataclass
class Addresses:
    scheduler: str
    detokenizer: str
    api: str
    tokenizers: list[str]

    @staticmethod
    def make(num_tokenizer: int) -> Addresses:
        root = tempfile.mkdtemp(prefix="minisgl-")
        ipc = lambda name: f"ipc://{os.path.join(root, name)}"  # noqa: E731
        tokenizers = [ipc(f"tokenizer{i}") for i in range(num_tokenizer)]
        return Addresses(ipc("scheduler"), ipc("detokenizer"), ipc("api"), tokenizers)


class Terminated(BaseException):
    """SIGTERM arrived: unwind to `launch_server`, whose `finally` stops the children."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


DEATH_GRACE_S = 0.5  # after a child died: time for clients to get their errors and see /health 503


def _child_main(target: Any, *args: Any) -> None:
    # A terminal's Ctrl-C (or systemd's SIGTERM) signals the whole process group; only the
    # parent acts on it, draining requests first and then stopping the children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    target(*args)


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.addrs = Addresses.make(args.num_tokenizer)
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.stopping = False
        self.child_died: str | None = None
        self.info: dict[str, Any] = {}  # what the scheduler reported once ready (max_seq_len)
        # called (from the watcher thread) with the reason when a child dies; None: SIGTERM self
        self.on_child_death: Any = None

    def _spawn(self, name: str, target: Any, *target_args: Any) -> Any:
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=_child_main, args=(target, *target_args, child), name=name, daemon=True
        )
        proc.start()
        logger.info("%s process started (pid %d)", name, proc.pid)
        self.procs.append(proc)
        return parent

    def start(self) -> None:
        from minisgl.distributed import free_port
        from minisgl.engine.engine import check_tp
        from minisgl.models.weight import resolve_model_path
        from minisgl.scheduler.io import run_follower, run_scheduler_process
        from minisgl.tokenizer.server import run_detokenizer, run_tokenizer

        args, a = self.args, self.addrs
        assert args.engine.model is not None  # __main__ resolves the default model
        model_path = resolve_model_path(args.engine.model)  # download once, before the children
        config, sched_cfg = replace(args.engine, model=model_path), args.scheduler
        port = 0
        if args.tp > 1:
            check_tp(config, args.tp)  # before any process starts
            port = free_port()
        spawn, tp, sched_io = self._spawn, args.tp, (a.scheduler, a.detokenizer)
        waits = [
            spawn("scheduler", run_scheduler_process, config, sched_cfg, tp, port, *sched_io),
            spawn("detokenizer", run_detokenizer, model_path, a.detokenizer, a.api, a.scheduler),
        ]
        for i, addr in enumerate(a.tokenizers):
            front = (a.scheduler, a.detokenizer, a.api)
            template = args.chat_template
            waits.append(spawn(f"tokenizer{i}", run_tokenizer, model_path, template, addr, *front))
        followers = [
            spawn(f"scheduler{rank}", run_follower, config, sched_cfg, rank, tp, port)
            for rank in range(1, args.tp)
        ]
        # followers say hello first, then ready once built (rank 0 is ready only after them)
        for payload in wait_ready(waits + followers, self.procs):
            self.info.update(payload or {})
        wait_ready(followers, self.procs[len(waits) :])
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        """Stop the server when any child dies, instead of hanging its clients."""
        from multiprocessing.connection import wait

        sentinels = {p.sentinel: p for p in self.procs}
        ready = wait(list(sentinels))
        if self.stopping:
            return
        dead = sentinels[ready[0]]
        dead.join(timeout=1)  # the exit code is known only once it is reaped
        logger.error("%s process died (exit code %s); shutting down", dead.name, dead.exitcode)
        self.child_died = f"{dead.name} process died (exit code {dead.exitcode})"
        if self.on_child_death is not None:
            self.on_child_death(self.child_died)
        else:
            os.kill(os.getpid(), signal.SIGTERM)

    def stop(self) -> None:
        self.stopping = True
        for p in self.procs:  # they ignore SIGTERM (see _child_main) and hold nothing to save
            if p.is_alive():
                p.kill()
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        # the directory of the ipc sockets (Addresses.make)
        shutil.rmtree(os.path.dirname(self.addrs.api.removeprefix("ipc://")), ignore_errors=True)


def launch_server(args: ServerArgs, front_end: Callable[[Launcher, Frontend], int]) -> int:
    """Start the children, run `front_end` (`serve_http`, or the shell) until it returns or
    SIGTERM, then stop the children; the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    # The default SIGTERM action would kill this process at once and orphan the children.
    signal.signal(signal.SIGTERM, _on_sigterm)
    launcher = Launcher(args)
    try:
        try:
            launcher.start()
        except (RuntimeError, ValueError) as e:
            print(f"minisgl: {e}", file=sys.stderr)
            return 1
        from minisgl.server.frontend import Frontend

        code = front_end(launcher, Frontend(launcher.addrs.tokenizers, launcher.addrs.api))
    except (Terminated, KeyboardInterrupt):  # a requested stop, or a dead child (see _watch)
        code = 0
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # let nothing interrupt the clean-up
            signal.signal(sig, signal.SIG_IGN)
        launcher.stop()
    if launcher.child_died:
        print(f"minisgl: {launcher.child_died}", file=sys.stderr)
        return 1
    return code


def serve_http(launcher: Launcher, frontend: Frontend) -> int:
    import uvicorn

    from minisgl.server.api_server import create_app

    args = launcher.args
    app = create_app(frontend, args, launcher.info["max_seq_len"])
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]  # float works
    )
    server = uvicorn.Server(config)

    def on_child_death(reason: str) -> None:
        frontend.fail_threadsafe(reason)  # in-flight requests end with an error, /health 503
        time.sleep(DEATH_GRACE_S)
        server.should_exit = server.force_exit = True  # nothing left to drain

    launcher.on_child_death = on_child_death
    print(f"minisgl: serving {args.engine.model} on http://{args.host}:{args.port}", flush=True)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again: that ends
    # here as Terminated / KeyboardInterrupt, caught by launch_server.
    server.run()
    return 0
