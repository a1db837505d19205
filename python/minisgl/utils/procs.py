"""Child-process helpers shared by the server launcher and the offline LLM's TP workers."""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from minisgl import env

logger = logging.getLogger(__name__)

TITLE_PREFIX = "minisgl::"


def set_title(name: str) -> None:
    """Name this process `minisgl::NAME` in ps / top / /proc/PID/cmdline (and comm, cut to 15
    bytes by the kernel), so operators and tests can tell the workers apart."""
    import setproctitle

    setproctitle.setproctitle(TITLE_PREFIX + name)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then move every object alive now (modules, the model,
    tokenizers, the app) out of the cyclic garbage collector's reach, as vLLM and SGLang do once
    a serving process is ready: a full collection then walks only what serving created, not the
    whole start-up heap (without it, an H100 server's frontend paused 50-230 ms at each full
    collection under load, stalling every stream). Returns the number of objects frozen; none
    with MINISGL_DISABLE_GC_FREEZE=1 (the ablation). Then --gc-threshold's counts apply, and
    with --gc-warning-threshold-secs long collections are logged from now on (`watch_gc`)."""
    if not env.disable_gc_freeze():
        gc.collect()
        gc.freeze()
    before = gc.get_threshold()
    if (counts := env.gc_threshold()) is not None:
        gc.set_threshold(*counts)
    if gc.get_threshold() != before:  # said once: the API server freezes again later
        logger.info("%s (pid %d): garbage-collection thresholds %s", title(), os.getpid(),
                    gc.get_threshold())  # fmt: skip
    watch_gc(env.gc_warning_threshold_s())  # serving's collections, not start-up's
    return gc.get_freeze_count()


_GC_WATCHERS: list[Callable[[str, dict[str, int]], None]] = []  # this process's, at most one


def watch_gc(threshold_s: float) -> Callable[[str, dict[str, int]], None] | None:
    """From now on, log a warning for every garbage collection of this process that takes longer
    than `threshold_s` (SGLang's --gc-warning-threshold-secs): while one runs, every stream the
    process serves waits. The callback installed (None: 0, or one is installed already)."""
    if threshold_s <= 0 or _GC_WATCHERS:
        return None
    started = [0.0]

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        elif (took := time.perf_counter() - started[0]) > threshold_s:
            logger.warning(
                "%s (pid %d): a generation-%d garbage collection took %.3f s, %d objects "
                "collected (--gc-warning-threshold-secs %g)",
                title(),
                os.getpid(),
                info["generation"],
                took,
                info["collected"],
                threshold_s,
            )

    gc.callbacks.append(on_gc)
    _GC_WATCHERS.append(on_gc)
    return on_gc


def title() -> str:
    """This process's name as `set_title` gave it; the main process (the API server's, or the
    user's with `LLM`) has its command line there, and is called "main process"."""
    import setproctitle

    name = setproctitle.getproctitle()
    return name if name.startswith(TITLE_PREFIX) else "main process"


def _parent_death_signal(sig: int) -> bool:
    """Linux: have the kernel send `sig` to this process when its parent dies, even by SIGKILL
    (prctl PR_SET_PDEATHSIG); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    PR_SET_PDEATHSIG = 1
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
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
# model work): one that dies before `exit_with_parent` runs is then still seen as gone. One that
# dies earlier still, while the interpreter imports torch, cannot be told from the new parent.
_FIRST_PARENT = os.getppid()
PARENT_POLL_S = 0.5  # how often the portable watch looks for a new parent pid
# The kernel's word that the parent died. Not SIGTERM itself: PR_SET_PDEATHSIG also fires when
# only the *thread* that started this process ends, which a parent pid that did not change tells
# apart; the watch then goes on.
PARENT_GONE_SIGNAL = signal.SIGUSR1


def exit_with_parent(kernel_signal: bool = True, interval: float = PARENT_POLL_S) -> None:
    """--exit-with-parent: send this process SIGTERM (its usual stop, which stops every child)
    once the process that started it is gone, however it died (SIGKILL, OOM, os._exit), so that
    a killed test runner or supervisor leaves no server behind. A thread polls os.getppid()
    every `interval` s (portable: an orphan gets a new parent); on Linux the kernel's signal
    (`kernel_signal`, main thread only) wakes it at once. Call after the SIGTERM handler is set."""
    parent, wake = _FIRST_PARENT, threading.Event()
    if kernel_signal and threading.current_thread() is threading.main_thread():
        # the handler only wakes the watch: logging from a signal handler could re-enter I/O
        signal.signal(PARENT_GONE_SIGNAL, lambda signum, frame: wake.set())
        _parent_death_signal(PARENT_GONE_SIGNAL)
    watch = threading.Thread(
        target=_watch_parent, args=(parent, wake, interval), name="parent-watch", daemon=True
    )
    watch.start()


def _watch_parent(parent: int, wake: threading.Event, interval: float) -> None:
    while os.getppid() == parent:  # checked once at once: it may have died before the prctl
        wake.wait(interval)
        wake.clear()
    logger.warning("parent process %d is gone (--exit-with-parent): shutting down", parent)
    os.kill(os.getpid(), signal.SIGTERM)


class Reaper:
    """A small process (`utils/reaper.py`, no torch) that outlives this one to clean up after
    it: when this process dies, however it dies, the reaper reads EOF on its stdin (only this
    process holds the pipe's other end), SIGKILLs the pids it was told about and removes
    `directory`. A clean stop says so and closes the pipe; the reaper then only exits."""

    def __init__(self, directory: str) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reaper.py")
        self.proc = subprocess.Popen(
            [sys.executable, "-I", script, directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # signals to the server's group (Ctrl-C, hang-up) are not for it
        )

    def watch(self, pid: int) -> None:
        """Kill `pid` too if this process dies first (PR_SET_PDEATHSIG's job on Linux)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{pid}\n".encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        """After a clean stop: nothing of its pids to kill (they may be recycled already)."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):  # BrokenPipeError: it was killed
            self.proc.stdin.write(b"stopped\n")
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
                    raise RuntimeError(
                        f"{proc.name} process exited during start-up (exit code {proc.exitcode})"
                    ) from None
                if status != "ready":
                    raise RuntimeError(payload)
                payloads[i] = payload
            elif not proc.is_alive() and not (i not in payloads and conn.poll()):
                raise RuntimeError(
                    f"{proc.name} process exited during start-up (exit code {proc.exitcode})"
                )
        time.sleep(0.05)
    return [payloads[i] for i in range(len(conns))]
