"""--exit-with-parent: the server stops as on SIGTERM once the process that started it is gone,
however it died (a test runner or a supervisor killed outright), so that it leaves no server
behind. `ServingLauncher.start` starts the watch (in the main process, before the model loads);
its SIGTERM unwinds through `launch_server`, which stops the children."""

from __future__ import annotations

import logging
import os
import signal
import threading

from minisgl.utils.procs import parent_death_signal

logger = logging.getLogger(__name__)

# The parent as early as this process can tell (the extensions load as the command line is
# parsed, before any model work): one that dies before `exit_with_parent` runs is still seen gone.
_FIRST_PARENT = os.getppid()


def exit_with_parent(kernel_signal: bool = True, interval: float = 0.5) -> None:
    """SIGTERM this process (its usual stop) once the process that started it is gone."""
    # A thread polls os.getppid() every `interval` s (portable: an orphan gets a new parent);
    # on Linux the kernel's signal (`kernel_signal`, main thread only) wakes it at once. That
    # signal is SIGUSR1, not SIGTERM: PR_SET_PDEATHSIG also fires when only the *thread* that
    # started this process ends, which an unchanged parent pid tells apart.
    parent, wake = _FIRST_PARENT, threading.Event()
    if kernel_signal and threading.current_thread() is threading.main_thread():
        # the handler only wakes the watch: logging from a signal handler could re-enter I/O
        signal.signal(signal.SIGUSR1, lambda signum, frame: wake.set())
        parent_death_signal(signal.SIGUSR1)

    def watch() -> None:
        while os.getppid() == parent:
            wake.wait(interval)
            wake.clear()
        logger.warning("parent process %d is gone (--exit-with-parent): shutting down", parent)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
