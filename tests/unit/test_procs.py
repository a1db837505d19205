"""utils/procs.wait_ready: a child that dies before its ready message gives a clear error (its
name and exit code), never the pipe's EOFError traceback."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from minisgl.utils.procs import wait_ready


def die_at_once(conn) -> None:
    conn.close()
    os._exit(3)  # as an import error in a worker would, before any message


def report_ready(conn) -> None:
    conn.send(("ready", 7))


def start(target, name: str):
    """A spawned child given the sending end of a pipe; (its receiving end, the process)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, args=(child,), name=name)
    proc.start()
    child.close()
    return parent, proc


def test_child_dying_before_ready_names_it_and_its_exit_code():
    parent, proc = start(die_at_once, "scheduler_0")
    with pytest.raises(
        RuntimeError, match=r"scheduler_0 process exited during start-up \(exit code 3\)"
    ):
        wait_ready([parent], [proc])


def test_ready_payload_is_returned():
    parent, proc = start(report_ready, "detokenizer")
    assert wait_ready([parent], [proc]) == [7]
    proc.join()
