"""What every HTTP request passes before FastAPI (`Gate`): the API key, the body's size, and
text that is not valid Unicode. Each refusal is an OpenAI-shaped JSON error, counted by status
like every other response. The serving extension's gate (the `gate` point) adds the limit on
requests in progress and on the time a body may take to arrive."""

from __future__ import annotations

import hmac
import json
import logging
import re
from typing import TYPE_CHECKING, Any, NamedTuple

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.extension import extensions
from minisgl.server.protocol import error_body

if TYPE_CHECKING:
    from minisgl.server.args import ServerArgs
    from minisgl.server.frontend import Frontend

logger = logging.getLogger(__name__)

# a JSON \u escape of a UTF-16 surrogate: the way a valid UTF-8 body can carry text that is not
# valid Unicode. A pair (an emoji, as ASCII-only encoders write it) matches too: only the walk
# tells them apart. A plain pattern: one with lookarounds to find lone ones takes ~25 ms per MB.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
LONE_SURROGATE = "a lone UTF-16 surrogate"
NOT_UTF8 = "bytes that are not UTF-8"


class Refusal(NamedTuple):
    status: int
    message: str
    code: str
    param: str | None = None
    headers: dict[str, str] | None = None


def _valid_text(text: str) -> bool:
    try:
        text.encode()  # in C: a lone surrogate fails
        return True
    except UnicodeEncodeError:
        return False


def _shown(name: str, raw: bool) -> str:
    """A field name that is not valid Unicode, printable: as the client wrote it, its stray
    bytes as \\xNN (`raw`: they were decoded as surrogateescape's lone surrogates), else its
    escaped surrogates as \\uNNNN."""
    if raw:
        try:
            return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # an escaped surrogate among the stray bytes
            pass
    return name.encode("utf-8", "backslashreplace").decode()


def _text_path(document: str | bytes, raw: bool) -> str | None:
    """The path (e.g. `messages[0].content`) of the first string of a JSON document, in
    document order, that is not valid Unicode; None when there is none or it is not JSON."""
    try:
        todo: list[tuple[str, Any]] = [("body", json.loads(document))]
    except (ValueError, RecursionError):
        return None
    while todo:  # depth first, without recursion (the nesting is the client's)
        path, value = todo.pop()
        if isinstance(value, str) and not _valid_text(value):
            return path
        if isinstance(value, dict):
            children = [(k if path == "body" else f"{path}.{k}", v) for k, v in value.items()]
            for name, _ in children:
                if not _valid_text(name):  # a field's name
                    return _shown(name, raw)
        elif isinstance(value, list):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        todo.extend(reversed(children))
    return None


def invalid_text_path(body: bytes) -> tuple[str | None, str] | None:
    """Where a body holds text that is not valid Unicode, and what it is: (a field path, or
    None when the bytes are in no string of a JSON document, and why), or None. Decoded
    strictly: json.loads would take raw surrogate bytes ('surrogatepass') for lone surrogates
    that no message can carry, and other stray bytes fail there as a 500. A valid UTF-8 body
    is parsed here only when it holds a surrogate escape (a pair, or an escaped backslash
    before `ud800`, is a false alarm the walk clears); one that is not JSON is left to
    FastAPI, which says so."""
    if not body.isascii():  # ASCII, the common case, is valid UTF-8: no copy made
        try:
            body.decode()
        except UnicodeDecodeError:  # each stray byte a lone surrogate, found by the walk
            return _text_path(body.decode(errors="surrogateescape"), raw=True), NOT_UTF8
    if not SURROGATE_ESCAPE.search(body):
        return None
    path = _text_path(body, raw=False)
    return None if path is None else (path, LONE_SURROGATE)


def credentials_refused(headers: list[tuple[bytes, bytes]], key: bytes) -> str | None:
    """Why a request's credentials do not carry the API key, or None when they do. RFC 7235:
    exactly one Authorization header, `auth-scheme 1*SP token`, the scheme in any case; or the
    key alone in one x-api-key header, as Anthropic's clients send it."""
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
    """What every HTTP request passes before FastAPI (see the module). An exception the app did
    not turn into a response becomes an OpenAI-shaped JSON 500 here, so that it is counted too.
    Pure ASGI (not BaseHTTPMiddleware), so that an endpoint still sees its client disconnect;
    the body is read whole here and replayed to the app."""

    def __init__(
        self, app: ASGIApp, args: ServerArgs, frontend: Frontend, paths: frozenset[str]
    ) -> None:
        """`frontend`: its `metrics` count the responses; `paths`: the app's own (any other is
        counted as "other")."""
        self.app, self.max_body = app, args.max_request_bytes
        self.api_key = None if args.api_key is None else args.api_key.encode()
        self.observer = frontend.metrics
        self.paths = paths

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
            response = JSONResponse(body, r.status, headers=r.headers)
            await response(scope, receive, counted)

        if (refusal := self.check_head(scope)) is not None:
            return await refuse(refusal)
        body = await self.receive_body(scope, receive)
        if isinstance(body, Refusal):
            return await refuse(body)
        if body is None:
            return  # the client left before sending all of its body
        if (refusal := self.check_body(scope, body)) is not None:
            return await refuse(refusal)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.serve(scope, replay, counted)
        except Exception as e:
            if started:  # too late for a status: the connection is cut (uvicorn logs it)
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            message = f"internal server error ({type(e).__name__}); see the server log"
            await refuse(Refusal(500, message, "internal_error"))

    async def serve(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The app's answer to a request that passed (the serving extension counts them)."""
        await self.app(scope, receive, send)

    def check_head(self, scope: Scope) -> Refusal | None:
        """The refusals known from the request's head alone (its body not read)."""
        if self.api_key is not None and scope["path"] != "/health":
            if (why := credentials_refused(scope["headers"], self.api_key)) is not None:
                # RFC 7235: a 401 names the scheme it wants
                return Refusal(401, why, "invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return self.too_large()
        return None

    def check_body(self, scope: Scope, body: bytes) -> Refusal | None:
        if len(body) > self.max_body:  # no (or a false) Content-Length
            return self.too_large()
        if (bad := invalid_text_path(body)) is not None:
            where, why = bad
            message = f"{where or 'body'}: text is not valid Unicode ({why})"
            return Refusal(400, message, "invalid_unicode", where)
        return None

    def too_large(self) -> Refusal:
        return Refusal(413, f"request body is larger than {self.max_body} bytes", "body_too_large")

    async def receive_body(self, scope: Scope, receive: Receive) -> bytes | Refusal | None:
        """The body (`read_body`), or the refusal of one that takes too long (the serving
        extension's --timeout-body-read)."""
        return await self.read_body(receive)

    async def read_body(self, receive: Receive) -> bytes | None:
        """The whole body, or None if the client left first; reading stops past the limit."""
        body, more = bytearray(), True
        while more and len(body) <= self.max_body:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return bytes(body)
