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


def test_child_dying_before_ready_names_it_and_its_exit_code():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=die_at_once, args=(child,), name="scheduler_0")
    proc.start()
    child.close()
    with pytest.raises(
        RuntimeError, match=r"scheduler_0 process exited during start-up \(exit code 3\)"
    ):
        wait_ready([parent], [proc])


def test_ready_payload_is_returned():
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=report_ready, args=(child,), name="detokenizer")
    proc.start()
    child.close()
    assert wait_ready([parent], [proc]) == [7]
    proc.join()
