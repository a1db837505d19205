"""Bounds on the HTTP server's connections, on top of uvicorn's protocol (see `serve_http`).

uvicorn closes a kept-alive connection that stays silent after a response, but not one that
never sends a request, nor one that sends its headers a byte at a time: each holds a file
descriptor for ever, and once they run out every accept fails (logging an error each time) and
/health stops answering. Here every connection must complete a request's headers within
--timeout-keep-alive seconds of its opening (or of its previous response), and beyond
--max-connections open connections the one that has waited the longest for its client is
closed: idle, or still sending its request (its body within --timeout-body-read, which the
`Gate` enforces). A connection whose request the app is serving is never closed. When every
connection is busy, the `Gate` answers the requests beyond the limit 503 (/health excepted),
and beyond FD_RESERVE / 2 more connections new ones are closed at once: a total cap, so that
a flood cannot take every file descriptor."""

from __future__ import annotations

import asyncio
import logging
import select
import time
from collections import OrderedDict
from typing import Any

logger = logging.getLogger(__name__)
FD_RESERVE = 256  # file descriptors kept for everything but client connections
MAX_BACKLOG = 2048  # uvicorn's default listen backlog
BURSTS = 3  # backlogs of connections accepted before the first of them is seen (and closed)
RECHECK_S = 0.1  # a connection with unread bytes at its timeout: looked at again this soon
WARN_INTERVAL_S = 10.0  # shedding is logged at most this often: a flood must not fill the log


def connection_budget(max_connections: int) -> tuple[int, int]:
    """Raise the soft open-file limit to fit `max_connections` (up to the hard limit); the
    connections that fit (never more than asked) and the listen backlog. asyncio accepts up to
    a backlog of connections at a time before any is seen here (to be closed if over the
    limit), a few times over: room is kept for that too."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return max_connections, MAX_BACKLOG
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want, inf = max_connections + BURSTS * MAX_BACKLOG + FD_RESERVE, resource.RLIM_INFINITY
    if soft != inf and soft < want:
        soft = want if hard == inf else min(hard, want)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    if soft == inf or soft >= want:
        return max_connections, MAX_BACKLOG
    backlog = min(MAX_BACKLOG, max(16, (soft - FD_RESERVE) // (2 * BURSTS)))
    fits = max(1, soft - FD_RESERVE - BURSTS * backlog)
    if fits < max_connections:
        logger.warning(
            "--max-connections %d lowered to %d: the open-file limit is %d",
            max_connections,
            fits,
            soft,
        )
    return min(fits, max_connections), backlog


def unread_bytes(transport: Any) -> bool:
    """Whether the client's bytes wait in the socket, not yet read by the loop. After the loop
    was held up (a loaded machine), uvloop runs due timers before it reads the sockets: a
    request sent in time must not be taken for a silent client."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    try:
        readable, _, _ = select.select([sock.fileno()], [], [], 0)
    except (OSError, ValueError):  # closed meanwhile
        return False
    return bool(readable)


class ConnectionLimits:
    """Shared by every connection of one server: those waiting for their client (a request's
    head, or its body), the one waiting the longest first."""

    def __init__(self, max_connections: int, head_timeout: float) -> None:
        self.max_connections, self.head_timeout = max_connections, head_timeout
        self.idle: OrderedDict[Any, None] = OrderedDict()
        self.num_shed = 0
        self._warned_at, self._warned_count = 0.0, 0

    def waiting(self, conn: Any) -> None:
        self.idle[conn] = None
        self.idle.move_to_end(conn)

    def forget(self, conn: Any) -> None:
        self.idle.pop(conn, None)

    def close(self, conn: Any) -> None:
        self.forget(conn)
        # Out of uvicorn's set now: it leaves it only at connection_lost, a loop turn later (with
        # uvloop, after a whole burst of accepts), and until then make_room would count it.
        conn.connections.discard(conn)
        conn.transport.close()

    def make_room(self, new: Any) -> None:
        """`new` was just opened: close the connections that have waited longest for their
        clients beyond the limit. One still sending its request's body goes too, or a flood of
        bodies that never end (slowloris) would hold every connection for --timeout-body-read
        seconds, and the next flood for as long again."""
        excess = len(new.connections) - self.max_connections
        while excess > 0 and self.idle:
            conn = next(iter(self.idle))
            if conn is new:  # every other connection is busy
                break
            del self.idle[conn]  # a busy one comes back when its response is complete
            if conn.waiting_for_head or conn.reading_body:
                self.close(conn)
                self.num_shed += 1
                excess -= 1
        if excess > FD_RESERVE // 2:  # all busy, and file descriptors run short
            self.close(new)
            self.num_shed += 1
        self._warn()

    def close_waiting(self, connections: set[Any]) -> None:
        """Close every connection of `connections` (uvicorn's set) that waits for its client:
        the drain's end, where a request whose body has not come is not served."""
        for conn in list(connections):
            if conn.waiting_for_head or conn.reading_body:
                self.close(conn)

    def _warn(self) -> None:
        now = time.monotonic()
        if self.num_shed > self._warned_count and now - self._warned_at > WARN_INTERVAL_S:
            logger.warning(
                "closed %d idle HTTP connections so far: more than --max-connections %d were open",
                self.num_shed,
                self.max_connections,
            )
            self._warned_at, self._warned_count = now, self.num_shed

    def quiet_accept_errors(self, loop: asyncio.AbstractEventLoop) -> None:
        """asyncio logs every failed accept (with a traceback), up to a backlog of them each
        time the listening socket is ready: out of file descriptors, that is megabytes a
        second. Log them at most once per WARN_INTERVAL_S instead."""
        default = loop.get_exception_handler()
        last = [0.0]

        def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            if not str(context.get("message", "")).startswith("socket.accept() out of system"):
                if default is not None:
                    default(loop, context)
                else:
                    loop.default_exception_handler(context)
                return
            now = time.monotonic()
            if now - last[0] > WARN_INTERVAL_S:
                last[0] = now
                logger.error("cannot accept HTTP connections: %s", context.get("exception"))

        loop.set_exception_handler(handler)

    def protocol(self) -> type[asyncio.Protocol]:
        """uvicorn's HTTP protocol class (the one it would pick), bound by these limits."""
        from uvicorn.protocols.http.auto import AutoHTTPProtocol

        limits = self
        base: Any = AutoHTTPProtocol

        class BoundedProtocol(base):
            _head_timer: asyncio.TimerHandle | None = None
            _awaited: Any = None  # the request cycle when the wait began: a new request replaces it

            def connection_made(self, transport: Any) -> None:
                super().connection_made(transport)
                self._await_head()
                limits.make_room(self)

            def on_response_complete(self) -> None:
                super().on_response_complete()
                if not self.transport.is_closing():
                    self._await_head()

            def connection_lost(self, exc: Exception | None) -> None:
                limits.forget(self)
                if self._head_timer is not None:
                    self._head_timer.cancel()
                super().connection_lost(exc)

            @property
            def waiting_for_head(self) -> bool:
                """No request in progress, and none has begun since the wait began."""
                cycle = self.cycle
                return cycle is self._awaited and (cycle is None or cycle.response_complete)

            @property
            def reading_body(self) -> bool:
                """A request began since the wait began, and its body has not all come: the
                app waits for the client (nothing of its response is sent yet)."""
                cycle = self.cycle
                if cycle is None or cycle is self._awaited:
                    return False
                return cycle.more_body and not cycle.response_started

            def _await_head(self) -> None:
                if self._head_timer is not None:
                    self._head_timer.cancel()
                self._awaited = self.cycle
                self._head_timer = self.loop.call_later(limits.head_timeout, self._head_overdue)
                limits.waiting(self)

            def timeout_keep_alive_handler(self) -> None:
                """uvicorn's own keep-alive timeout: `_head_overdue` times that wait instead,
                and looks for unread bytes first."""

            def _head_overdue(self) -> None:
                self._head_timer = None
                if not self.waiting_for_head or self.transport.is_closing():
                    return
                if unread_bytes(self.transport):  # it came while the loop was held up
                    self._head_timer = self.loop.call_later(RECHECK_S, self._head_overdue)
                    return
                limits.close(self)

        return BoundedProtocol
