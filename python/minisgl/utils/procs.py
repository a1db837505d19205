"""Child-process helpers shared by the server launcher and the offline LLM's TP workers."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from typing import Any


def die_with_parent() -> None:
    """Linux: have the kernel kill this child when its parent dies, even by SIGKILL."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    parent = mp.parent_process()
    if parent is not None and os.getppid() != parent.pid:  # it died before the prctl
        os._exit(1)


def wait_ready(conns: list[Any], procs: list[Any]) -> list[Any]:
    """The next ("ready", payload) message of each child. A child that reports
    ("error", message), or any child that dies meanwhile, raises RuntimeError at once."""
    payloads: dict[int, Any] = {}
    while len(payloads) < len(conns):
        for i, (conn, proc) in enumerate(zip(conns, procs)):
            if i not in payloads and conn.poll():
                status, payload = conn.recv()
                if status != "ready":
                    raise RuntimeError(payload)
                payloads[i] = payload
            elif not proc.is_alive() and not (i not in payloads and conn.poll()):
                raise RuntimeError(
                    f"{proc.name} process exited during start-up (exit code {proc.exitcode})"
                )
        time.sleep(0.05)
    return [payloads[i] for i in range(len(conns))]
