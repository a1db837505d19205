"""Child-process helpers shared by the server launcher and the offline LLM's TP workers."""

from __future__ import annotations

import gc
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from typing import Any

import setproctitle

from minisgl import env

logger = logging.getLogger(__name__)

TITLE_PREFIX = "minisgl::"
_GC_WATCHED: list[bool] = []  # this process logs its long collections already


def set_title(name: str) -> None:
    """Name this process `minisgl::NAME` in ps / top / /proc/PID/cmdline."""
    setproctitle.setproctitle(TITLE_PREFIX + name)


def title() -> str:
    """This process's name as `set_title` gave it, else "main process"."""
    name = setproctitle.getproctitle()
    return name if name.startswith(TITLE_PREFIX) else "main process"


def freeze_startup_heap() -> int:
    """Once a serving process is ready: collect start-up's garbage and freeze what is alive,
    then apply MINISGL_GC_THRESHOLD and MINISGL_GC_WARNING_THRESHOLD_SECS; the objects frozen."""
    # As vLLM and SGLang do: a full collection then walks only what serving created, not the
    # whole start-up heap (before, an H100 server's frontend paused 50-230 ms at each one).
    # MINISGL_DISABLE_GC_FREEZE=1 is the ablation.
    if not env.disable_gc_freeze():
        gc.collect()
        gc.freeze()
    before = gc.get_threshold()
    if (counts := env.gc_threshold()) is not None:
        gc.set_threshold(*counts)
    if gc.get_threshold() != before:  # said once: the API server freezes again later
        logger.info("%s (pid %d): garbage-collection thresholds %s", title(), os.getpid(),
                    gc.get_threshold())  # fmt: skip
    if (threshold_s := env.gc_warning_threshold_s()) > 0 and not _GC_WATCHED:
        _GC_WATCHED.append(True)
        gc.callbacks.append(_gc_watch(threshold_s))
    return gc.get_freeze_count()


def _gc_watch(threshold_s: float) -> Any:
    """A gc callback that logs each collection longer than `threshold_s`."""
    # while one runs, every stream the process serves waits
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) > threshold_s:
            logger.warning(
                "%s (pid %d): a generation-%d garbage collection took %.3f s, %d objects "
                "collected (--gc-warning-threshold-secs %g)",
                *(title(), os.getpid(), info["generation"], took, info["collected"], threshold_s),
            )

    return on_gc


def _parent_death_signal(sig: int) -> bool:
    """Linux: the kernel sends `sig` when the parent dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        return ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0) == 0  # PDEATHSIG
    except (OSError, AttributeError):  # a libc without prctl
        return False


def die_with_parent() -> None:
    """Linux: have the kernel kill this child when its parent dies, even by SIGKILL."""
    if not _parent_death_signal(signal.SIGKILL):
        return
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


# The parent as early as this process can tell (when the launcher's modules load, before any
# model work): one that dies before `exit_with_parent` runs is then still seen as gone.
_FIRST_PARENT = os.getppid()


def exit_with_parent(kernel_signal: bool = True, interval: float = 0.5) -> None:
    """--exit-with-parent: SIGTERM this process (its usual stop) once the process that started
    it is gone, however it died, so that a killed test runner leaves no server behind."""
    # A thread polls os.getppid() every `interval` s (portable: an orphan gets a new parent);
    # on Linux the kernel's signal (`kernel_signal`, main thread only) wakes it at once. That
    # signal is SIGUSR1, not SIGTERM: PR_SET_PDEATHSIG also fires when only the *thread* that
    # started this process ends, which an unchanged parent pid tells apart.
    parent, wake = _FIRST_PARENT, threading.Event()
    if kernel_signal and threading.current_thread() is threading.main_thread():
        # the handler only wakes the watch: logging from a signal handler could re-enter I/O
        signal.signal(signal.SIGUSR1, lambda signum, frame: wake.set())
        _parent_death_signal(signal.SIGUSR1)

    def watch() -> None:
        while os.getppid() == parent:
            wake.wait(interval)
            wake.clear()
        logger.warning("parent process %d is gone (--exit-with-parent): shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


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
