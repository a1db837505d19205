"""What every HTTP request passes before FastAPI (`Gate`): two hooks with do-nothing defaults
(`check_head`, `body`), refusals as JSON errors, and the last resort for an exception the app
did not answer. The serving extension's gate (the `gate` point) fills the hooks: the API key,
the limits on the body and on requests in progress, and counts every response."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.extension import extensions
from minisgl.server.protocol import error_body

if TYPE_CHECKING:
    from minisgl.server.args import ServerArgs
    from minisgl.server.frontend import Frontend

logger = logging.getLogger(__name__)


class Refusal(NamedTuple):
    status: int
    message: str
    code: str
    param: str | None = None
    headers: dict[str, str] | None = None


class Gate:
    """Pure ASGI middleware (not BaseHTTPMiddleware: an endpoint still sees its client leave).
    `args`, `frontend` and `paths` (the app's own) are for a subclass's checks."""

    def __init__(
        self, app: ASGIApp, args: ServerArgs, frontend: Frontend, paths: frozenset[str]
    ) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        async def refuse(r: Refusal) -> None:
            shape = extensions().error_bodies.get(scope["path"], error_body)  # another API's?
            body = shape(r.status, r.message, r.param, r.code)
            await JSONResponse(body, r.status, headers=r.headers)(scope, receive, send)

        if (refusal := self.check_head(scope)) is not None:
            return await refuse(refusal)
        body = await self.body(scope, receive)
        if isinstance(body, Refusal):
            return await refuse(body)
        if body is None:
            return  # the client left before sending all of its body
        try:
            await self.serve(scope, body, watched)
        except Exception as e:
            if started:  # too late for a status: the connection is cut (uvicorn logs it)
                raise
            if isinstance(e, UnicodeEncodeError):  # a lone surrogate cannot travel (msgpack)
                why = "the request's text is not valid Unicode (an unpaired surrogate)"
                return await refuse(Refusal(400, why, "invalid_unicode"))
            logger.exception("%s %s failed", scope["method"], scope["path"])
            message = f"internal server error ({type(e).__name__}); see the server log"
            await refuse(Refusal(500, message, "internal_error"))

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)

    def check_head(self, scope: Scope) -> Refusal | None:
        """A refusal of the request from its head alone (here none)."""
        return None

    async def body(self, scope: Scope, receive: Receive) -> Receive | Refusal | None:
        """The `receive` the app reads the body from (here `receive` itself), a refusal, or
        None: the client left before sending all of it."""
        return receive
