"""An API process's HTTP serving under load and at its stop (the `gate` and `http_server`
points):

- `ServingGate`: the core's Gate plus the API key (--api-key: 401, never for /health,
  `auth.py`); the body read whole, checked and replayed to the app: --max-request-bytes (413),
  text that is not valid Unicode (400, `text.py`), --timeout-body-read (408); the limit on
  requests in progress (this process's share of --max-connections; beyond it 503, never for
  /health); and every response counted by path and status (/metrics), refusals included;
- `serving_http_server`: uvicorn bounded by `ConnectionLimits` (--max-connections,
  --timeout-keep-alive), whose drain (SIGTERM, --shutdown-timeout) ends the requests still
  running with an error event just before it runs out, and whose exits log no traceback."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.ext.serving.auth import credentials_refused
from minisgl.ext.serving.connections import ConnectionLimits, connection_budget
from minisgl.ext.serving.options import serving_options
from minisgl.ext.serving.text import invalid_text_path
from minisgl.server.gate import Gate, refuse
from minisgl.server.protocol import APIError

if TYPE_CHECKING:
    from minisgl.ext.serving.frontend import ServingFrontend
    from minisgl.server.args import ServerArgs
    from minisgl.server.frontend import Frontend

# Probes answered even when every request slot is taken: an orchestrator that sees them fail
# restarts a server that is only busy.
HEALTH_PATHS = frozenset({"/health", "/health_generate"})
CUT_MARGIN_S = 0.5  # the drain's requests still running end this long before it runs out
FORCED_EXIT_WAIT_S = 1.0  # a forced exit's wait for the requests whose connections it closed


def expects_body(scope: Scope) -> bool:
    """Whether the request has a body to wait for: HTTP/1.1 says a request without
    Content-Length or Transfer-Encoding has none, so its one receive returns at once."""
    for name, value in scope["headers"]:
        if name == b"transfer-encoding" or (name == b"content-length" and value != b"0"):
            return True
    return False


class ServingGate(Gate):
    """The Gate, with the API key (401); the body read whole within --timeout-body-read (408)
    and checked: at most --max-request-bytes (413), valid Unicode (400); this API process's
    share of --max-connections as the requests it serves at once (others than /health beyond
    it 503); and every response counted (`paths`: the app's own, others counted as "other")."""

    def __init__(
        self, app: ASGIApp, args: ServerArgs, frontend: Frontend, paths: frozenset[str]
    ) -> None:
        super().__init__(app)
        serving = cast("ServingFrontend", frontend)  # its launcher's
        self.paths, self.metrics = paths, serving.metrics
        options = serving_options(args)
        self.api_key = None if options.api_key is None else options.api_key.encode()
        self.body_timeout, self.max_body = options.timeout_body_read, options.max_request_bytes
        self.max_requests = -(-options.max_connections // serving.api_count)
        # Requests passed to the app, /health included. Not those whose body is still coming:
        # they cost nothing but a connection, which ConnectionLimits sheds when needed (one
        # shed a moment ago still counted would refuse the request that took its place).
        self.serving = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.response(path, message["status"])
            await send(message)

        refusal = self.check_head(scope)
        body = await self.body(scope, receive) if refusal is None else refusal
        if isinstance(body, APIError):
            return await refuse(body, scope, receive, counted)
        if body is None:
            return  # the client left before sending all of its body
        self.serving += 1
        try:  # the core's Gate: an exception the app did not answer as a JSON error
            await super().__call__(scope, body, counted)
        finally:
            self.serving -= 1

    def over_limit(self, scope: Scope) -> APIError | None:
        limit = self.max_requests
        if self.serving >= limit and scope["path"] not in HEALTH_PATHS:
            message = f"server overloaded: {limit} requests in progress (the limit); retry later"
            return APIError(503, message, code="overloaded", headers={"Retry-After": "1"})
        return None

    def check_key(self, scope: Scope) -> APIError | None:
        if self.api_key is None or scope["path"] == "/health":
            return None
        if (why := credentials_refused(scope["headers"], self.api_key)) is None:
            return None
        # RFC 7235: a 401 names the scheme it wants
        return APIError(401, why, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    def check_head(self, scope: Scope) -> APIError | None:
        """Overloaded: refused before anything else (no body read); then the API key."""
        if (refusal := self.over_limit(scope) or self.check_key(scope)) is not None:
            return refusal
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return self.too_large()
        return None

    async def body(self, scope: Scope, receive: Receive) -> Receive | APIError | None:
        """The body read whole and checked (`check_body`), replayed to the app."""
        body = await self.receive_body(scope, receive)
        if body is None or isinstance(body, APIError):
            return body
        if (refusal := self.check_body(scope, body)) is not None:
            return refusal
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        return replay

    def check_body(self, scope: Scope, body: bytes) -> APIError | None:
        if len(body) > self.max_body:  # a false Content-Length, or none
            return self.too_large()
        if (bad := invalid_text_path(body)) is not None:
            where, why = bad
            message = f"{where or 'body'}: text is not valid Unicode ({why})"
            return APIError(400, message, where, "invalid_unicode")
        return self.over_limit(scope)  # the limit again: others came while this body did

    def too_large(self) -> APIError:
        message = f"request body is larger than {self.max_body} bytes"
        return APIError(413, message, code="body_too_large")

    async def receive_body(self, scope: Scope, receive: Receive) -> bytes | APIError | None:
        """The whole body (within --timeout-body-read when one is to come), or None if the
        client left first; reading stops past the limit."""
        if not expects_body(scope):
            return await self.read_body(receive)
        try:
            return await asyncio.wait_for(self.read_body(receive), self.body_timeout)
        except asyncio.TimeoutError:
            return self.too_slow()

    async def read_body(self, receive: Receive) -> bytes | None:
        body, more = bytearray(), True
        while more and len(body) <= self.max_body:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
        return bytes(body)

    def too_slow(self) -> APIError:
        """A body that did not arrive in time: its connection is closed after the answer, so
        that it counts no longer (the rest of a body would otherwise still be read)."""
        message = (
            f"request body did not arrive within {self.body_timeout:g} s (--timeout-body-read)"
        )
        return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


class _CutShort(logging.Filter):
    """uvicorn logs a request that the server's exit cancelled (the drain ran out, or a
    failure's forced exit) as an application error, with a CancelledError traceback: no bug,
    so one line instead. With no drain (--shutdown-timeout 0) it also says, as an error, that
    it cancels 0 tasks: dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Cancel %s running task") and record.args == (0,):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, asyncio.CancelledError) and str(record.msg).startswith("Exception in"):
            record.msg, record.args = "a request was cut short: the server is stopping", ()
            record.exc_info, record.exc_text = None, None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


async def _end_forced(server: Any, limits: ConnectionLimits) -> None:
    """A failure's exit (`serve_http`: its requests got their errors already) skips uvicorn's
    drain and the app's lifespan shutdown: the tasks left would be cancelled as the loop
    closes, the lifespan's logging a CancelledError traceback. Close every connection (the
    requests still there see their client gone and end), wait a moment for them, and end the
    lifespan."""
    for conn in list(server.server_state.connections):
        limits.close(conn)
    if server.server_state.tasks:
        await asyncio.wait(set(server.server_state.tasks), timeout=FORCED_EXIT_WAIT_S)
    with contextlib.suppress(asyncio.TimeoutError):  # a hung shutdown handler
        await asyncio.wait_for(server.lifespan.shutdown(), FORCED_EXIT_WAIT_S)


def make_server(
    config: Any,
    frontend: Frontend,
    limits: ConnectionLimits,
    drain_s: float,
    on_shutdown: Callable[[], None] | None = None,
) -> Any:
    """uvicorn's server, whose drain (SIGTERM) ends the requests still running with the error
    event (or a 503) just before `drain_s` (--shutdown-timeout) runs out, not a bare close,
    and drops then those whose body has not come. `on_shutdown` is called as the drain begins.
    Its exits log no traceback (see `_end_forced`, `_CutShort`)."""
    import uvicorn

    errors = logging.getLogger("uvicorn.error")  # after uvicorn.Config set its logging up
    if not any(isinstance(f, _CutShort) for f in errors.filters):
        errors.addFilter(_CutShort())

    class Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            limits.quiet_accept_errors(asyncio.get_running_loop())
            await super().startup(sockets)

        def cut(self, reason: str) -> None:
            """The drain's end: the requests still running end with `reason`, those whose
            head or body has not come are dropped."""
            frontend.fail(reason)
            limits.close_waiting(self.server_state.connections)

        async def shutdown(self, sockets: Any = None) -> None:
            if on_shutdown is not None:
                on_shutdown()
            reason = f"server shut down before the request finished ({drain_s:g} s drain)"
            timer = None
            if drain_s <= CUT_MARGIN_S:
                self.cut(reason)  # uvicorn's 0.1 s pause before cutting lets the errors out
            else:
                timer = asyncio.get_running_loop().call_later(
                    drain_s - CUT_MARGIN_S, self.cut, reason
                )
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()
            if self.force_exit:
                await _end_forced(self, limits)

    return Server(config)


def serving_http_server(args: ServerArgs, app: Any, frontend: ServingFrontend) -> Any:
    """The app under bounded uvicorn, as one API process serves it (each of
    --api-server-count gets its share of --max-connections; its drain begins with the
    Frontend's `on_drain`)."""
    import uvicorn

    options = serving_options(args)
    share = -(-options.max_connections // frontend.api_count)
    max_connections, backlog = connection_budget(share)
    limits = ConnectionLimits(max_connections, options.timeout_keep_alive)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        http=limits.protocol(),
        backlog=backlog,
        # no limit_concurrency: its 503 refuses /health too; the gate limits requests instead
        timeout_keep_alive=options.timeout_keep_alive,  # type: ignore[arg-type]  # float works
        timeout_graceful_shutdown=args.shutdown_timeout,  # type: ignore[arg-type]
    )
    return make_server(config, frontend, limits, args.shutdown_timeout, frontend.on_drain)
