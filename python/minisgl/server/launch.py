"""`python -m minisgl`: start the scheduler, detokenizer and tokenizer processes, wait until
each is ready, then run the front end (HTTP, or the shell: `__main__` chooses) in this process.
Any child that dies, or a pipeline that hangs (the watchdog, `Frontend`), takes the whole server
down with exit code 1 (in-flight requests get an error first); on exit every child is stopped.
SIGTERM drains in-flight requests for up to --shutdown-timeout seconds; those still running
then end with an error. Children are titled `minisgl::NAME`; a `Reaper` removes the sockets'
directory even when this process is killed outright."""

from __future__ import annotations

import asyncio
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
from minisgl.utils.procs import Reaper, die_with_parent, set_title, wait_ready

if TYPE_CHECKING:
    from minisgl.server.connections import ConnectionLimits
    from minisgl.server.frontend import Frontend

logger = logging.getLogger("minisgl")


@dataclass
class Addresses:
    root: str  # a private temp directory (mode 0700): the ipc sockets, the TP rendezvous file
    scheduler: str
    detokenizer: str
    api: str
    tokenizers: list[str]

    @staticmethod
    def make(num_tokenizer: int) -> Addresses:
        root = tempfile.mkdtemp(prefix="minisgl-")
        ipc = lambda name: f"ipc://{os.path.join(root, name)}"  # noqa: E731
        tokenizers = [ipc(f"tokenizer{i}") for i in range(num_tokenizer)]
        return Addresses(root, ipc("scheduler"), ipc("detokenizer"), ipc("api"), tokenizers)


class Terminated(BaseException):
    """SIGTERM arrived: unwind to `launch_server`, whose `finally` stops the children."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


DEATH_GRACE_S = 1.5  # after a failure: time for clients (on a loaded machine) to get their errors and see /health 503
CUT_MARGIN_S = 0.5  # the drain's requests still running end this long before it runs out


def _child_main(name: str, target: Any, *args: Any) -> None:
    # A terminal's Ctrl-C (or systemd's SIGTERM) signals the whole process group; only the
    # parent acts on it, draining requests first and then stopping the children itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    die_with_parent()
    set_title(name)
    target(*args)


class Launcher:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.addrs = Addresses.make(args.num_tokenizer)
        logger.info("sockets in %s", self.addrs.root)
        self.reaper = Reaper(self.addrs.root)
        self.ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.stopping = False
        self.failure: str | None = None  # why the server stops with code 1 (a child died, hung)
        self._fail_lock = threading.Lock()
        self.info: dict[str, Any] = {}  # what the scheduler reported once ready (max_seq_len)
        # called (from a thread of its own) with the reason of a failure; None: SIGTERM self
        self.on_failure: Callable[[str], None] | None = None

    def _spawn(self, name: str, target: Any, *target_args: Any) -> Any:
        """Start `target(*target_args, ready)` in a child titled `minisgl::NAME`; the parent's
        end of the `ready` pipe."""
        parent, child = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=_child_main, args=(name, target, *target_args, child), name=name, daemon=True
        )
        proc.start()
        assert proc.pid is not None  # started
        self.reaper.watch(proc.pid)
        logger.info("%s process started (pid %d)", name, proc.pid)
        self.procs.append(proc)
        return parent

    def start(self) -> None:
        from minisgl.distributed import rendezvous_file
        from minisgl.engine.engine import check_tp
        from minisgl.models.weight import resolve_model_path
        from minisgl.scheduler.io import run_follower, run_scheduler_process
        from minisgl.tokenizer.server import run_detokenizer, run_tokenizer

        args, a = self.args, self.addrs
        assert args.engine.model is not None  # __main__ resolves the default model
        model_path = resolve_model_path(args.engine.model)  # download once, before the children
        config, sched_cfg = replace(args.engine, model=model_path), args.scheduler
        if args.tp > 1:
            check_tp(config, args.tp)  # before any process starts
        meet = rendezvous_file(a.root)  # TP ranks meet through a file: no TCP listener
        spawn, tp, sched_io = self._spawn, args.tp, (a.scheduler, a.detokenizer)
        waits = [
            spawn("scheduler_0", run_scheduler_process, config, sched_cfg, tp, meet, *sched_io),
            spawn("detokenizer", run_detokenizer, model_path, a.detokenizer, a.api, a.scheduler),
        ]
        for i, addr in enumerate(a.tokenizers):
            front = (a.scheduler, a.detokenizer, a.api)
            template = args.chat_template
            waits.append(spawn(f"tokenizer_{i}", run_tokenizer, model_path, template, addr, *front))
        followers = [
            spawn(f"scheduler_{rank}", run_follower, config, sched_cfg, rank, tp, meet)
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
        self.fail(f"{dead.name} process died (exit code {dead.exitcode})")

    def fail(self, reason: str) -> None:
        """A child died or the pipeline hung: stop the server, which exits with code 1 (the
        first failure only; called from a thread other than the event loop's)."""
        with self._fail_lock:
            if self.stopping or self.failure is not None:
                return
            self.failure = reason
        logger.error("%s; shutting down", reason)
        if self.on_failure is not None:
            self.on_failure(reason)
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
        shutil.rmtree(self.addrs.root, ignore_errors=True)
        self.reaper.stop()


def launch_server(args: ServerArgs, front_end: Callable[[Launcher, Frontend], int]) -> int:
    """Start the children, run `front_end` (`serve_http`, or the shell) until it returns or
    SIGTERM, then stop the children; the exit code."""
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s"
    )
    hide_api_key()
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

        addrs, timeout = launcher.addrs, args.watchdog_timeout
        frontend = Frontend(addrs.tokenizers, addrs.api, timeout, on_hang=launcher.fail)
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


def make_server(config: Any, frontend: Frontend, limits: ConnectionLimits, drain_s: float) -> Any:
    """uvicorn's server, whose drain (SIGTERM) ends the requests still running with the error
    event (or a 503) just before `drain_s` (--shutdown-timeout) runs out, not a bare close."""
    import uvicorn

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            limits.quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)

        async def shutdown(self, sockets: Any = None) -> None:
            reason = f"server shut down before the request finished ({drain_s:g} s drain)"
            cut = None
            if drain_s <= CUT_MARGIN_S:
                frontend.fail(reason)  # uvicorn's 0.1 s pause before cutting lets the errors out
            else:
                cut = asyncio.get_running_loop().call_later(
                    drain_s - CUT_MARGIN_S, frontend.fail, reason
                )
            try:
                await super().shutdown(sockets)
            finally:
                if cut is not None:
                    cut.cancel()

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


def serve_http(launcher: Launcher, frontend: Frontend) -> int:
    import uvicorn

    from minisgl.server.api_server import create_app
    from minisgl.server.connections import ConnectionLimits, connection_budget

    args = launcher.args
    app = create_app(frontend, args, launcher.info["max_seq_len"])
    max_connections, backlog = connection_budget(args.max_connections)
    limits = ConnectionLimits(max_connections, args.timeout_keep_alive)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=limits.protocol(),
        backlog=backlog,
        limit_concurrency=max_connections + 1,  # requests beyond it: 503
        timeout_keep_alive=args.timeout_keep_alive,  # type: ignore[arg-type]  # float works
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
    )
    server = make_server(config, frontend, limits, args.shutdown_timeout)

    def on_failure(reason: str) -> None:
        frontend.fail_threadsafe(reason)  # in-flight requests end with an error, /health 503
        time.sleep(DEATH_GRACE_S)
        server.should_exit = server.force_exit = True  # nothing left to drain

    launcher.on_failure = on_failure
    print(f"minisgl: serving {args.engine.model} on http://{args.host}:{args.port}", flush=True)
    # uvicorn stops gracefully on SIGTERM / SIGINT, then raises the signal again: that ends
    # here as Terminated / KeyboardInterrupt, caught by launch_server.
    server.run()
    return 0
