"""What every HTTP request passes before FastAPI (`Gate`): the last resort for an exception the
app did not answer, a JSON error in the path's API's shape. ext/serving's subclass (the `gate`
point) adds its checks ahead: the API key, limits on the body and on requests, response counts."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.extension import extensions
from minisgl.server.protocol import APIError, error_body

logger = logging.getLogger(__name__)


async def refuse(e: APIError, scope: Scope, receive: Receive, send: Send) -> None:
    """Answer `e` as the JSON error of the path's API (OpenAI's unless `error_bodies` says)."""
    shape = extensions().error_bodies.get(scope["path"], error_body)
    body = shape(e.status, e.message, e.param, e.code)
    await JSONResponse(body, e.status, headers=e.headers)(scope, receive, send)


class Gate:
    """Pure ASGI middleware (not BaseHTTPMiddleware: an endpoint still sees its client leave).
    `create_app` passes `args`, `frontend` and `paths` (the app's own): for a subclass's checks."""

    def __init__(self, app: ASGIApp, **for_subclass: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if started:  # too late for a status: the connection is cut (uvicorn logs it)
                raise
            if isinstance(e, UnicodeEncodeError):  # a lone surrogate cannot travel (msgpack)
                why = "the request's text is not valid Unicode (an unpaired surrogate)"
                refusal = APIError(400, why, code="invalid_unicode")
                return await refuse(refusal, scope, receive, send)
            logger.exception("%s %s failed", scope["method"], scope["path"])
            message = f"internal server error ({type(e).__name__}); see the server log"
            await refuse(APIError(500, message, code="internal_error"), scope, receive, send)
