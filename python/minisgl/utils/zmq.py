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
_PUSH_LINGER_MS = 1000  # push sockets' close() waits this long to flush (e.g. a final ExitMsg)
_DROPPED = object()  # what `_decode` returns for a message that does not decode


def _decode(data: bytes) -> Any:
    try:
        return decode(data)
    except ValueError:  # not one of our messages (see `decode`)
        logger.exception("dropped an internal message that does not decode (%d bytes)", len(data))
        return _DROPPED


class _Queue:
    def __init__(self, context: zmq.Context, kind: int, addr: str, create: bool) -> None:
        self.socket: Any = context.socket(kind)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, _PUSH_LINGER_MS if kind == zmq.PUSH else 0)
        if create:
            self.socket.bind(addr)
        else:
            self.socket.connect(addr)

    def close(self) -> None:
        self.socket.close()


class ZmqPushQueue(_Queue):
    def __init__(self, addr: str, create: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PUSH, addr, create)

    def put(self, msg: Any) -> None:
        self.socket.send(encode(msg), copy=False)


class ZmqPullQueue(_Queue):
    def __init__(self, addr: str, create: bool) -> None:
        super().__init__(zmq.Context.instance(), zmq.PULL, addr, create)

    def get(self, timeout: float | None = None) -> Any:
        """Next message; blocks forever when timeout is None, else None after `timeout` s (per
        message received: a dropped one starts the wait again)."""
        while True:
            if timeout is not None and not self.socket.poll(int(timeout * 1000)):
                return None
            if (msg := _decode(self.socket.recv())) is not _DROPPED:
                return msg

    def get_nowait(self) -> Any | None:
        while True:
            try:
                msg = _decode(self.socket.recv(zmq.NOBLOCK))
            except zmq.Again:
                return None
            if msg is not _DROPPED:
                return msg


class ZmqAsyncPushQueue(_Queue):
    def __init__(self, addr: str, create: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PUSH, addr, create)

    async def put(self, msg: Any) -> None:
        await self.put_encoded(encode(msg))

    async def put_encoded(self, data: bytes) -> None:
        """Send a message already encoded (so that its encoding can fail before anything else)."""
        await self.socket.send(data, copy=False)


class ZmqAsyncPullQueue(_Queue):
    def __init__(self, addr: str, create: bool) -> None:
        super().__init__(zmq.asyncio.Context.instance(), zmq.PULL, addr, create)

    async def get(self) -> Any:
        while (msg := _decode(await self.socket.recv())) is _DROPPED:
            pass
        return msg
