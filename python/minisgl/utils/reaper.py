"""`python reaper.py DIRECTORY`: started by `utils/procs.py: Reaper`. Reads pids from stdin,
one a line, until EOF (its parent closed the pipe, or died); unless the last line was "stopped"
(a clean stop: the parent reaped them itself), SIGKILLs those pids, then removes DIRECTORY. A script of its own, importing nothing of minisgl (nor torch): it starts
in milliseconds and holds a few MB."""

from __future__ import annotations

import os
import shutil
import signal
import sys


def main(directory: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle("minisgl::reaper")
    except ImportError:  # a title is a convenience
        pass
    # the parent's SIGINT / SIGTERM are for it; this process only waits for its end
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    lines = [line.strip() for line in sys.stdin]
    stopped = bool(lines) and lines[-1] == "stopped"
    for pid in [] if stopped else [int(x) for x in lines if x.isdigit()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # gone already (a recycled pid of another user's is not ours to kill)
    shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
