"""OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/generate (native, token ids), /health, /stats and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.server.metrics import CONTENT_TYPE, tree_rss_bytes

DISCONNECT_POLL_S = 0.2  # how often a non-streamed request checks that its client is still there
JSON_OBJECT_SCHEMA = '{"type": "object"}'  # what response_format {"type": "json_object"} means
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by anyone


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "server_error" if status >= 500 else "invalid_request_error"
    )
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int,
    message: str,
    param: str | None = None,
    code: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status, headers=headers)


class Gate:
    """What every HTTP request passes before FastAPI: the API key, the body size limit, and the
    count of responses by status. Pure ASGI (not BaseHTTPMiddleware), so that an endpoint still
    sees its client disconnect; the body is read whole here and replayed to the app."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | None,
        max_body: int,
        frontend: Frontend,
        paths: frozenset[str],
    ):
        self.app, self.api_key, self.max_body = app, api_key, max_body
        self.statuses = frontend.metrics.http
        self.paths = paths  # the app's own; any other is counted as "other"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.statuses.labels(path, str(message["status"])).inc()
            await send(message)

        headers = dict(scope["headers"])
        if self.api_key and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                reject = error_response(401, "invalid or missing API key", code="invalid_api_key")
                return await reject(scope, receive, counted)
        too_large = f"request body is larger than {self.max_body} bytes"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            reject = error_response(413, too_large, code="body_too_large")
            return await reject(scope, receive, counted)
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending all of its body
            body += message.get("body", b"")
            if len(body) > self.max_body:  # no (or a false) Content-Length
                reject = error_response(413, too_large, code="body_too_large")
                return await reject(scope, receive, counted)
            more = message.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, counted)


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client leaves first; then cancel it, which aborts its requests
    (a streamed response notices the disconnect itself; a plain one would run to the end)."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                return Response(status_code=CLIENT_GONE)
    finally:
        task.cancel()  # no-op when done


class StreamOptions(BaseModel):
    include_usage: bool = False


# Larger integers cannot travel in a message (msgpack) nor live in a tensor: refuse them here.
Int64 = Annotated[int, Field(ge=-(2**63), lt=2**63)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    model: str | None = None
    max_tokens: Int64 | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int64 = -1
    min_p: float = 0.0
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    n: int = Field(1, ge=1, le=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    # structured generation: OpenAI's response_format, or SGLang's json_schema / regex / ebnf
    response_format: ResponseFormat | None = None
    json_schema: str | dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None


def grammar_fields(req: SamplingFields) -> dict[str, Any]:
    """The SamplingParams constraint of a request (json_schema, regex or ebnf), if any."""
    given = {
        k: v for k, v in (("json_schema", req.json_schema), ("regex", req.regex), ("ebnf", req.ebnf))
        if v is not None
    }  # fmt: skip
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            schema: Any = JSON_OBJECT_SCHEMA
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required", "response_format")
        else:
            schema = fmt.json_schema.schema_
        given["response_format"] = schema
    if len(given) > 1:
        names = " and ".join(given)
        raise APIError(400, f"give one output constraint, not {names}", next(iter(given)))
    if "response_format" in given:
        return {"json_schema": given.pop("response_format")}
    return given


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Int64 | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int64 | None = None


class GenerateRequest(BaseModel):
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


def sampling_params(req: SamplingFields, max_tokens: int, seed_offset: int) -> SamplingParams:
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    # choice i of n samples with seed + i; kept within int64
    seed = None if req.seed is None else (req.seed + seed_offset) % 2**63
    try:
        return SamplingParams(
            temperature=req.temperature,
            top_k=req.top_k,
            top_p=req.top_p,
            min_p=req.min_p,
            max_tokens=max_tokens,
            ignore_eos=req.ignore_eos,
            stop_token_ids=list(req.stop_token_ids or []),
            seed=seed,
            **grammar_fields(req),
        )
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def chat_content(m: ChatMessage) -> str:
    if isinstance(m.content, list):  # OpenAI content parts: keep the text ones
        texts = [p.get("text") for p in m.content if p.get("type") == "text"]
        if not all(isinstance(t, str) for t in texts):
            raise APIError(400, "messages: a text content part needs a string 'text'", "messages")
        return "".join(texts)  # type: ignore[arg-type]
    return m.content or ""


def create_app(frontend: Frontend, args: ServerArgs, max_seq_len: int) -> FastAPI:
    app = FastAPI(title="minisgl")
    model_name = args.model or ""
    served = {model_name, model_name.rstrip("/").split("/")[-1]}

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON")
        return error_response(
            400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}", ".".join(loc) or None
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail))

    def check_model(name: str | None) -> None:
        if name is not None and name not in served:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    def reply_error(r: UserReply, first: bool) -> APIError:
        """The HTTP error for a reply that ended its request with an error."""
        message = r.error or "request failed"
        if r.finish_reason == "timeout":
            return APIError(504, message, code="timeout")
        if frontend.dead:
            return APIError(503, message, code="server_unavailable")
        # a first reply's error is a refusal (bad prompt...); a later one is the server's fault
        return APIError(400 if first else 500, message)

    def error_event(e: APIError) -> str:
        return f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"

    def admit(num: int) -> None:
        """Refuse new work when the pipeline is dead or too many requests wait to start."""
        if frontend.dead:
            raise APIError(
                503, f"server is shutting down: {frontend.dead}", code="server_unavailable"
            )
        limit, queued = args.max_queued_requests, frontend.num_queued
        if limit is not None and queued >= limit:
            raise APIError(
                503,
                f"server overloaded: {queued} requests are waiting to start (limit {limit}); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    async def first_reply(msg: TokenizeMsg) -> tuple[AsyncIterator[UserReply], UserReply]:
        """Start a request and wait for its first reply, so refusals become HTTP errors."""
        stream = frontend.stream(msg, args.request_timeout)
        first = await stream.__anext__()
        if first.error is not None:
            await stream.aclose()
            raise reply_error(first, first=True)
        return stream, first

    async def run_choices(
        msgs: list[TokenizeMsg],
    ) -> list[tuple[AsyncIterator[UserReply], UserReply]]:
        admit(len(msgs))
        started = []
        try:
            for m in msgs:
                started.append(await first_reply(m))
        except BaseException:
            for stream, _ in started:
                await stream.aclose()
            raise
        return started

    async def merged(
        started: list[tuple[AsyncIterator[UserReply], UserReply]],
    ) -> AsyncIterator[tuple[int, UserReply]]:
        """Replies of all choices as they come, tagged with the choice index."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, stream: AsyncIterator[UserReply], first: UserReply) -> None:
            await queue.put((i, first))
            if not first.finished:
                async for r in stream:
                    await queue.put((i, r))

        tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(started)]
        try:
            done = 0
            while done < len(tasks):
                i, r = await queue.get()
                done += r.finished
                yield i, r
        finally:
            for t in tasks:
                t.cancel()
            # a stream must be left by its pump before it can be closed here
            await asyncio.gather(*tasks, return_exceptions=True)
            for s, _ in started:
                await s.aclose()

    def make_msgs(req: SamplingFields, max_tokens: int, **source: Any) -> list[TokenizeMsg]:
        ids = source.get("input_ids") or []
        if any(not 0 <= t < 2**31 for t in ids):  # the detokenizer could not even decode them
            raise APIError(400, "prompt token ids must be in [0, 2**31)", "prompt")
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        return [
            TokenizeMsg(
                frontend.new_uid(),
                params=sampling_params(req, max_tokens, i),
                stop=stop,
                skip_special_tokens=req.skip_special_tokens,
                **source,
            )
            for i in range(req.n)
        ]

    def usage(prompt: int, completion: int) -> dict[str, int]:
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    async def respond(req: SamplingFields, msgs: list[TokenizeMsg], chat: bool) -> Any:
        started = await run_choices(msgs)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{msgs[0].uid}"
        created, model = int(time.time()), model_name
        obj = "chat.completion" if chat else "text_completion"
        if not req.stream:
            texts, reasons = [""] * len(msgs), [None] * len(msgs)
            prompt, completion = [0] * len(msgs), [0] * len(msgs)
            async with aclosing(merged(started)) as replies:
                async for i, r in replies:
                    if r.error is not None:
                        raise reply_error(r, first=False)
                    texts[i] += r.text_delta
                    prompt[i], completion[i] = r.prompt_tokens, r.completion_tokens
                    reasons[i] = r.finish_reason if r.finished else None
            choices = [
                {"index": i, "message": {"role": "assistant", "content": t}, "finish_reason": fr}
                if chat
                else {"index": i, "text": t, "logprobs": None, "finish_reason": fr}
                for i, (t, fr) in enumerate(zip(texts, reasons))
            ]
            return {
                "id": rid,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(prompt[0], sum(completion)),
            }

        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def events() -> AsyncIterator[str]:
            chunk_obj = "chat.completion.chunk" if chat else "text_completion"

            def chunk(choices: list[dict], **extra: Any) -> str:
                body = {
                    "id": rid,
                    "object": chunk_obj,
                    "created": created,
                    "model": model,
                    "choices": choices,
                    **extra,
                }
                return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

            if chat:
                yield chunk(
                    [
                        {
                            "index": i,
                            "delta": {"role": "assistant", "content": ""},
                            "finish_reason": None,
                        }
                        for i in range(len(msgs))
                    ]
                )
            prompt, completion = [0] * len(msgs), [0] * len(msgs)
            async with aclosing(merged(started)) as replies:
                async for i, r in replies:
                    if r.error is not None:  # the client sees an error, not a truncated answer
                        yield error_event(reply_error(r, first=False))
                        return
                    prompt[i], completion[i] = r.prompt_tokens, r.completion_tokens
                    fr = r.finish_reason if r.finished else None
                    if not r.text_delta and not r.token_ids and fr is None:
                        continue
                    if chat:
                        delta = {"content": r.text_delta} if r.text_delta else {}
                        yield chunk([{"index": i, "delta": delta, "finish_reason": fr}])
                    else:
                        text = r.text_delta
                        yield chunk(
                            [{"index": i, "text": text, "logprobs": None, "finish_reason": fr}]
                        )
            if include_usage:
                yield chunk([], usage=usage(prompt[0], sum(completion)))
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.get("/health")
    async def health() -> JSONResponse:
        if frontend.dead:
            return error_response(503, frontend.dead)
        return JSONResponse({"status": "ok"})

    @app.get("/stats")
    async def stats() -> dict[str, Any]:
        """Scheduler snapshot (running requests, KV pages), refreshed when it goes idle, plus the
        api server's view: requests in flight and not started yet, RSS of all processes."""
        return frontend.stats.__dict__ | {
            "in_flight": len(frontend.requests),
            "queued": frontend.num_queued,
            "rss_bytes": tree_rss_bytes(),
        }

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": 0,
            "owned_by": "minisgl",
            "max_model_len": max_seq_len,
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await unless_disconnected(request, complete(req))

    async def complete(req: CompletionRequest) -> Any:
        check_model(req.model)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, "only one prompt per request is supported", "prompt")
            prompt = prompt[0]
        source = (
            {"text": None, "input_ids": list(prompt)}
            if isinstance(prompt, list)
            else {"text": prompt, "input_ids": None}
        )
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        msgs = make_msgs(req, max_tokens, chat=None, **source)
        return await respond(req, msgs, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await unless_disconnected(request, chat_complete(req))

    async def chat_complete(req: ChatRequest) -> Any:
        check_model(req.model)
        max_tokens = req.max_completion_tokens or req.max_tokens
        chat = [{"role": m.role, "content": chat_content(m)} for m in req.messages]
        msgs = make_msgs(
            req,
            max_tokens if max_tokens is not None else max_seq_len,
            text=None,
            input_ids=None,
            chat=chat,
        )
        return await respond(req, msgs, chat=True)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        return await unless_disconnected(request, native_generate(req))

    async def native_generate(req: GenerateRequest) -> Any:
        if (req.input_ids is None) == (req.text is None):
            raise APIError(400, "give exactly one of input_ids and text", "input_ids")
        params = {"temperature": 0.0, "max_tokens": 128, **req.sampling_params}
        if "max_new_tokens" in params:  # the native name
            params["max_tokens"] = params.pop("max_new_tokens")
        try:  # a bad value here is the client's error, not the server's (500)
            fields = SamplingFields(**params)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            if loc == "max_tokens" and "max_new_tokens" in req.sampling_params:
                loc = "max_new_tokens"
            raise APIError(400, f"sampling_params.{loc}: {err['msg']}", "sampling_params") from None
        if fields.max_tokens is None:
            raise APIError(
                400, "sampling_params.max_new_tokens must be an integer", "sampling_params"
            )
        fields.n = 1
        msg = make_msgs(
            fields, fields.max_tokens, text=req.text, input_ids=req.input_ids, chat=None
        )[0]
        admit(1)
        stream, first = await first_reply(msg)

        async def replies() -> AsyncIterator[UserReply]:
            try:
                yield first
                if not first.finished:
                    async for r in stream:
                        yield r
            finally:
                await stream.aclose()  # aborts the request if it has not finished

        if not req.stream:
            ids, text, last = [], "", first
            async with aclosing(replies()) as rs:
                async for r in rs:
                    if r.error is not None:
                        raise reply_error(r, first=False)
                    ids += r.token_ids
                    text += r.text_delta
                    last = r
            return {
                "output_ids": ids,
                "text": text,
                "finish_reason": last.finish_reason,
                "prompt_tokens": last.prompt_tokens,
                "completion_tokens": last.completion_tokens,
            }

        async def events() -> AsyncIterator[str]:
            async with aclosing(replies()) as rs:
                async for r in rs:
                    if r.error is not None:
                        yield error_event(reply_error(r, first=False))
                        return
                    body = {
                        "token_ids": r.token_ids,
                        "text": r.text_delta,
                        "finished": r.finished,
                        "finish_reason": r.finish_reason,
                    }
                    yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.on_event("startup")
    async def _start() -> None:
        frontend.start()

    app.add_middleware(
        Gate,
        api_key=args.api_key,
        max_body=args.max_request_bytes,
        frontend=frontend,
        paths=frozenset(getattr(r, "path", "") for r in app.routes),
    )
    return app
