"""The garbage collector of every server process (the `process_ready` point): once a process is
ready its start-up heap is frozen, then MINISGL_GC_THRESHOLD and MINISGL_GC_WARNING_THRESHOLD_SECS
apply (what --gc-threshold and --gc-warning-threshold-secs set, `export_gc_settings`)."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import TYPE_CHECKING, Any

import setproctitle

from minisgl.env import flag
from minisgl.ext.serving.options import serving_options
from minisgl.utils.procs import TITLE_PREFIX

if TYPE_CHECKING:
    from minisgl.server.args import ServerArgs

logger = logging.getLogger(__name__)
# The server's default: with Python's 700 10 10, the API process's full collections (20-37 ms
# on an H100) each held back every stream of an all-at-once burst (docs/benchmarks.md, session 20).
SERVER_GC_THRESHOLD = (700, 10, 1000)
_WATCHED: list[bool] = []  # this process logs its long collections already


def export_gc_settings(args: ServerArgs) -> None:
    """The collector's settings, for every server process to read once ready (spawned children
    copy the environment): the flags, else what the caller's environment says, else the
    server's default thresholds."""
    options = serving_options(args)
    if options.gc_warning_threshold_secs > 0:
        os.environ["MINISGL_GC_WARNING_THRESHOLD_SECS"] = str(options.gc_warning_threshold_secs)
    if options.gc_threshold is not None:
        os.environ["MINISGL_GC_THRESHOLD"] = ",".join(map(str, options.gc_threshold))
    elif not os.environ.get("MINISGL_GC_THRESHOLD", "").strip():
        os.environ["MINISGL_GC_THRESHOLD"] = ",".join(map(str, SERVER_GC_THRESHOLD))


def warning_threshold_s() -> float:
    """MINISGL_GC_WARNING_THRESHOLD_SECS: a ready process logs every garbage collection longer
    than this; unset or 0: none."""
    value = os.environ.get("MINISGL_GC_WARNING_THRESHOLD_SECS", "").strip()
    try:
        seconds = float(value or 0)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < float("inf"):
        raise ValueError(
            f"MINISGL_GC_WARNING_THRESHOLD_SECS={value!r}: expected a finite number of seconds >= 0"
        )
    return seconds


def thresholds() -> tuple[int, ...] | None:
    """MINISGL_GC_THRESHOLD: one to three integers >= 0, comma-separated, for `gc.set_threshold`
    in a ready process; unset or empty: Python's own."""
    value = os.environ.get("MINISGL_GC_THRESHOLD", "").strip()
    if not value:
        return None
    try:
        counts = tuple(int(x) for x in value.split(","))
    except ValueError:
        counts = ()
    if not 1 <= len(counts) <= 3 or min(counts) < 0:
        raise ValueError(
            f"MINISGL_GC_THRESHOLD={value!r}: expected one to three integers >= 0, e.g. 700,10,100"
        )
    return counts


def title() -> str:
    """This process's name as `utils.procs.set_title` gave it, else "main process"."""
    name = setproctitle.getproctitle()
    return name if name.startswith(TITLE_PREFIX) else "main process"


def on_ready() -> None:
    """Freeze what start-up left alive, then apply the thresholds and the warning."""
    # As vLLM and SGLang do: a full collection then walks only what serving created, not the
    # whole start-up heap (before, an H100 server's frontend paused 50-230 ms at each one).
    # MINISGL_DISABLE_GC_FREEZE=1 is the ablation.
    if not flag("MINISGL_DISABLE_GC_FREEZE"):
        gc.collect()
        gc.freeze()
    before = gc.get_threshold()
    if (counts := thresholds()) is not None:
        gc.set_threshold(*counts)
    if gc.get_threshold() != before:  # said once: the API server freezes again later
        logger.info("%s (pid %d): garbage-collection thresholds %s", title(), os.getpid(),
                    gc.get_threshold())  # fmt: skip
    if (threshold_s := warning_threshold_s()) > 0 and not _WATCHED:
        _WATCHED.append(True)
        gc.callbacks.append(_watch(threshold_s))


def _watch(threshold_s: float) -> Any:
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
