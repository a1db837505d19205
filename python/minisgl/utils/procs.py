"""Child-process helpers shared by the server launcher and the offline LLM's TP workers."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable
from typing import Any, TypeVar

import setproctitle

from minisgl.extension import extensions

T = TypeVar("T")

TITLE_PREFIX = "minisgl::"


def set_title(name: str) -> None:
    """Name this process `minisgl::NAME` in ps / top / /proc/PID/cmdline."""
    setproctitle.setproctitle(TITLE_PREFIX + name)


def freeze_startup_heap() -> int:
    """A serving process is ready: the collector back on (its children start without it), the
    `process_ready` point (ext/serving freezes the start-up heap); the objects frozen."""
    gc.enable()
    if (ready := extensions().process_ready) is not None:
        ready()
    return gc.get_freeze_count()


def parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends `sig` when the parent dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # PDEATHSIG
    except (OSError, AttributeError, TypeError):  # not Linux: a libc without prctl
        return False


def die_with_parent() -> None:
    """Linux: have the kernel kill this child when its parent dies, even by SIGKILL."""
    if not parent_death_signal(signal.SIGKILL):
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


def build_or_report(what: str, ready: Any, build: Callable[[], T]) -> T:
    """`build()`; its error goes to the launcher through `ready` (printed there), exit code 1."""
    try:
        return build()
    except Exception as e:
        ready.send(("error", f"{what} failed to start: {type(e).__name__}: {e}"))
        raise SystemExit(1) from None


def spawn(ctx: Any, name: str, target: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    """Start `target(*args, ready, **kwargs)` in a daemon child of the multiprocessing context
    `ctx` -> (the parent's end of its `ready` pipe, the process)."""
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(*args, child), kwargs=kwargs, name=name, daemon=True)
    proc.start()
    return parent, proc


def stop_children(procs: list[Any], grace: float = 0.0) -> None:
    """Give the children `grace` seconds in all to end by themselves, then kill those left and
    reap them (for 5 s more at most)."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.is_alive():
            proc.kill()
    deadline = time.monotonic() + 5
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))


def wait_ready(conns: list[Any], procs: list[Any]) -> list[Any]:
    """The next ("ready", payload) message of each child. A child that reports
    ("error", message), or any child that dies meanwhile, raises RuntimeError at once."""
    payloads: dict[int, Any] = {}
    while len(payloads) < len(conns):
        for i, (conn, proc) in enumerate(zip(conns, procs)):
            if i not in payloads and conn.poll():
                try:
                    status, payload = conn.recv()
                except EOFError:  # it died before a word: its own stderr says why
                    proc.join(timeout=5)
                    raise RuntimeError(_exited(proc)) from None
                if status != "ready":
                    raise RuntimeError(payload)
                payloads[i] = payload
            elif not proc.is_alive() and not (i not in payloads and conn.poll()):
                raise RuntimeError(_exited(proc))
        time.sleep(0.05)
    return [payloads[i] for i in range(len(conns))]


def _exited(proc: Any) -> str:
    return f"{proc.name} process exited during start-up (exit code {proc.exitcode})"
