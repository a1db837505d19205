"""What every HTTP request passes before FastAPI (`Gate`): the API key."""

# Each refusal, and an exception the app did not answer, is an OpenAI-shaped JSON error counted
# by status like every other response. The serving extension's gate (the `gate` point) reads the
# body whole first (`body`) for the checks of its size and text, and adds the limit on requests
# in progress and the body's read timeout.

from __future__ import annotations

import hmac
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


def credentials_refused(headers: list[tuple[bytes, bytes]], key: bytes) -> str | None:
    """Why a request's credentials do not carry the API key, or None when they do."""
    # RFC 7235: exactly one Authorization header, `auth-scheme 1*SP token`, the scheme in any
    # case; or the key alone in one x-api-key header, as Anthropic's clients send it.
    x_api_key = [value for name, value in headers if name == b"x-api-key"]
    if len(x_api_key) == 1 and hmac.compare_digest(x_api_key[0], key):
        return None
    given = [value for name, value in headers if name == b"authorization"]  # names: lower case
    scheme, _, token = (given[0] if given else b"").partition(b" ")
    matches = hmac.compare_digest(token.lstrip(b" "), key)  # always made: constant time
    if len(given) > 1:
        return f"{len(given)} Authorization headers: send exactly one ('Bearer KEY')"
    if scheme.lower() != b"bearer" or not matches:
        return "invalid or missing API key"
    return None


class Gate:
    """Pure ASGI middleware (not BaseHTTPMiddleware: an endpoint still sees its client leave);
    `paths`: the app's own (responses elsewhere are counted as "other")."""

    def __init__(
        self, app: ASGIApp, args: ServerArgs, frontend: Frontend, paths: frozenset[str]
    ) -> None:
        self.app, self.paths = app, paths
        self.api_key = None if args.api_key is None else args.api_key.encode()
        self.observer = frontend.metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.observer.response(path, message["status"])
            await send(message)

        async def refuse(r: Refusal) -> None:
            shape = extensions().error_bodies.get(scope["path"], error_body)  # another API's?
            body = shape(r.status, r.message, r.param, r.code)
            await JSONResponse(body, r.status, headers=r.headers)(scope, receive, counted)

        if (refusal := self.check_head(scope)) is not None:
            return await refuse(refusal)
        body = await self.body(scope, receive)
        if isinstance(body, Refusal):
            return await refuse(body)
        if body is None:
            return  # the client left before sending all of its body
        try:
            await self.serve(scope, body, counted)
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
        if self.api_key is not None and scope["path"] != "/health":
            if (why := credentials_refused(scope["headers"], self.api_key)) is not None:
                # RFC 7235: a 401 names the scheme it wants
                return Refusal(401, why, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return None

    async def body(self, scope: Scope, receive: Receive) -> Receive | Refusal | None:
        """The `receive` the app reads the body from (here `receive` itself), a refusal, or
        None: the client left before sending all of it."""
        return receive
