"""PUSH/PULL ZMQ queues of `minisgl.message` objects; `create=True` binds (the endpoint's owner),
else connects. A message that does not decode is logged and dropped: it takes no process down."""

from __future__ import annotations

import logging
from typing import Any

import zmq
import zmq.asyncio

from minisgl.message import decode, encode

logger = logging.getLogger(__name__)
_PUSH_LINGER_MS = 1000  # push sockets' close() waits this long to flush (e.g. a final ExitMsg)


def _decode(data: bytes) -> Any:
    """The message, or None for one that does not decode (no one sends None)."""
    try:
        return decode(data)
    except ValueError:  # not one of our messages (see `decode`)
        logger.exception("dropped an internal message that does not decode (%d bytes)", len(data))
        return None


class _Queue:
    kind = zmq.PULL
    context: Any = zmq.Context

    def __init__(self, addr: str, create: bool) -> None:
        self.socket: Any = self.context.instance().socket(self.kind)
        # no high-water marks: a slow reader must not block the scheduler's send
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.RCVHWM, 0)
        self.socket.setsockopt(zmq.LINGER, _PUSH_LINGER_MS if self.kind == zmq.PUSH else 0)
        (self.socket.bind if create else self.socket.connect)(addr)

    def close(self) -> None:
        self.socket.close()


class ZmqPushQueue(_Queue):
    kind = zmq.PUSH

    def put(self, msg: Any) -> None:
        self.socket.send(encode(msg), copy=False)


class ZmqPullQueue(_Queue):
    def get(self, timeout: float | None = None) -> Any:
        """Next message; blocks forever when timeout is None, else None after `timeout` s (per
        message received: a dropped one starts the wait again)."""
        while timeout is None or self.socket.poll(int(timeout * 1000)):
            if (msg := _decode(self.socket.recv())) is not None:
                return msg
        return None

    def get_nowait(self) -> Any | None:
        return self.get(timeout=0)


class ZmqAsyncPushQueue(_Queue):
    kind = zmq.PUSH
    context = zmq.asyncio.Context

    async def put(self, msg: Any) -> None:
        await self.put_encoded(encode(msg))

    async def put_encoded(self, data: bytes) -> None:
        """Send a message already encoded (so that its encoding can fail before anything else)."""
        await self.socket.send(data, copy=False)


class ZmqAsyncPullQueue(_Queue):
    context = zmq.asyncio.Context

    async def get(self) -> Any:
        while (msg := _decode(await self.socket.recv())) is None:
            pass
        return msg
