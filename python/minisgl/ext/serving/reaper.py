"""The server's clean-up when the launcher is killed outright (SIGKILL, OOM): `Reaper` starts
this file as a script (`main`), which imports nothing of minisgl (nor torch), so it starts at
once. It reads pids from stdin, one a line, until EOF (its parent closed the pipe, or died);
unless the last line was "stopped", it SIGKILLs them, then removes the sockets' directory.
(On Linux the kernel also kills each child with its parent: `utils.procs.die_with_parent`.)"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys


class Reaper:
    """A small process (this file as a script: `main`) that outlives this one: when this
    process dies, however it dies, the reaper reads EOF on its stdin, SIGKILLs the pids it was
    told about and removes `directory`. A clean stop says so first; the reaper then only exits."""

    def __init__(self, directory: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-I", os.path.abspath(__file__), directory],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            # signals to the server's group (Ctrl-C, hang-up) are not for it
            start_new_session=True,
        )
        assert self.proc.stdin is not None
        self.pipe = self.proc.stdin

    def watch(self, pid: int) -> None:
        self.pipe.write(f"{pid}\n".encode())
        self.pipe.flush()

    def stop(self) -> None:
        with contextlib.suppress(OSError):  # BrokenPipeError: it was killed
            self.pipe.write(b"stopped\n")
            self.pipe.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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
