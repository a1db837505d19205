"""PUSH/PULL queues over ZMQ that carry `minisgl.message` objects.

`create=True` binds the address (the long-lived owner of the endpoint), otherwise connects.
High-water marks are off: a slow reader must not block the scheduler's send, and messages are
small. A message that does not decode is logged and dropped: one malformed message must not
take a process (and with it the server) down."""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message import decode, encode

logger = logging.getLogger(__name__)
# Push sockets wait this long on close() to flush queued messages (e.g. a final ExitMsg).
_PUSH_LINGER_MS = 1000
_DROPPED = object()  # what `_decode` returns for a message that does not decode


def _decode(data: bytes) -> Any:
    try:
        return decode(data)
    except ValueError:  # not one of our messages (see `decode`)
        logger.exception("dropped an internal message that does not decode (%d bytes)", len(data))
        return _DROPPED


def _setup(sock: zmq.Socket, addr: str, create: bool, linger_ms: int) -> None:
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, linger_ms)
    if create:
        sock.bind(addr)
    else:
        sock.connect(addr)


class ZmqPushQueue:
    def __init__(self, addr: str, create: bool) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUSH)
        _setup(self.socket, addr, create, _PUSH_LINGER_MS)

    def put(self, msg: Any) -> None:
        self.socket.send(encode(msg), copy=False)

    def close(self) -> None:
        self.socket.close()


class ZmqPullQueue:
    def __init__(self, addr: str, create: bool) -> None:
        self.socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PULL)
        _setup(self.socket, addr, create, 0)

    def get(self, timeout: float | None = None) -> Any:
        """Next message; blocks forever when timeout is None, else None after `timeout` s (per
        message received: a dropped one starts the wait again)."""
        while True:
            if timeout is not None and not self.socket.poll(int(timeout * 1000)):
                return None
            msg = _decode(self.socket.recv())
            if msg is not _DROPPED:
                return msg

    def get_nowait(self) -> Any | None:
        while True:
            try:
                msg = _decode(self.socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None
            if msg is not _DROPPED:
                return msg

    def close(self) -> None:
        self.socket.close()


class ZmqAsyncPushQueue:
    def __init__(self, addr: str, create: bool) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.PUSH)
        _setup(self.socket, addr, create, _PUSH_LINGER_MS)

    async def put(self, msg: Any) -> None:
        await self.put_encoded(encode(msg))

    async def put_encoded(self, data: bytes) -> None:
        """Send a message already encoded (so that its encoding can fail before anything else)."""
        await self.socket.send(data, copy=False)

    def close(self) -> None:
        self.socket.close()


class ZmqAsyncPullQueue:
    def __init__(self, addr: str, create: bool) -> None:
        self.socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        _setup(self.socket, addr, create, 0)

    async def get(self) -> Any:
        while (msg := _decode(await self.socket.recv())) is _DROPPED:
            pass
        return msg

    def close(self) -> None:
        self.socket.close()
