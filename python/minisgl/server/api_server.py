"""OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/generate (native, token ids), /health and /stats."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.core import SamplingParams
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.frontend import Frontend


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        self.status, self.message, self.param, self.code = status, message, param, code


def error_response(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error"}.get(
        status, "invalid_request_error"
    )
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = Field(1, ge=1, le=64)
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None


class GenerateRequest(BaseModel):
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    stream: bool = False


def sampling_params(req: SamplingFields, max_tokens: int, seed_offset: int) -> SamplingParams:
    if max_tokens <= 0:
        raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}", "max_tokens")
    seed = None if req.seed is None else req.seed + seed_offset
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
        )
    except ValueError as e:
        raise APIError(400, str(e), str(e).split(" ")[0]) from None


def chat_content(m: ChatMessage) -> str:
    if isinstance(m.content, list):  # OpenAI content parts: keep the text ones
        return "".join(p.get("text", "") for p in m.content if p.get("type") == "text")
    return m.content or ""


def create_app(
    frontend: Frontend, model_name: str, max_seq_len: int, api_key: str | None = None
) -> FastAPI:
    app = FastAPI(title="minisgl")
    served = {model_name, model_name.rstrip("/").split("/")[-1]}

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.param, e.code)

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

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key and request.url.path != "/health":
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return error_response(401, "invalid or missing API key", code="invalid_api_key")
        return await call_next(request)

    def check_model(name: str | None) -> None:
        if name is not None and name not in served:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "model_not_found",
            )

    async def first_reply(msg: TokenizeMsg) -> tuple[AsyncIterator[UserReply], UserReply]:
        """Start a request and wait for its first reply, so refusals become HTTP errors."""
        stream = frontend.stream(msg)
        first = await stream.__anext__()
        if first.error is not None:
            await stream.aclose()
            raise APIError(400, first.error)
        return stream, first

    async def run_choices(
        msgs: list[TokenizeMsg],
    ) -> list[tuple[AsyncIterator[UserReply], UserReply]]:
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
            for s, _ in started:
                await s.aclose()

    def make_msgs(req: SamplingFields, max_tokens: int, **source: Any) -> list[TokenizeMsg]:
        ids = source.get("input_ids") or []
        if any(not 0 <= t < 2**31 for t in ids):  # the detokenizer could not even decode them
            raise APIError(400, "prompt token ids must be non-negative", "prompt")
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
            async for i, r in merged(started):
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
            async for i, r in merged(started):
                prompt[i], completion[i] = r.prompt_tokens, r.completion_tokens
                fr = r.finish_reason if r.finished else None
                if not r.text_delta and not r.token_ids and fr is None:
                    continue
                if chat:
                    delta = {"content": r.text_delta} if r.text_delta else {}
                    yield chunk([{"index": i, "delta": delta, "finish_reason": fr}])
                else:
                    yield chunk(
                        [{"index": i, "text": r.text_delta, "logprobs": None, "finish_reason": fr}]
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
        """Scheduler snapshot (running requests, KV pages), refreshed when it goes idle."""
        return frontend.stats.__dict__ | {"in_flight": len(frontend.queues)}

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
    async def completions(req: CompletionRequest) -> Any:
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
    async def chat_completions(req: ChatRequest) -> Any:
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
    async def generate(req: GenerateRequest) -> Any:
        if (req.input_ids is None) == (req.text is None):
            raise APIError(400, "give exactly one of input_ids and text", "input_ids")
        try:  # a bad value here is the client's error, not the server's (500)
            fields = SamplingFields(**{"temperature": 0.0, **req.sampling_params})
            max_tokens = int(
                req.sampling_params.get(
                    "max_new_tokens", req.sampling_params.get("max_tokens", 128)
                )
            )
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err["loc"])
            raise APIError(400, f"sampling_params.{loc}: {err['msg']}", "sampling_params") from None
        except (TypeError, ValueError) as e:
            raise APIError(400, f"sampling_params: {e}", "sampling_params") from None
        fields.n = 1
        msg = make_msgs(fields, max_tokens, text=req.text, input_ids=req.input_ids, chat=None)[0]
        stream, first = await first_reply(msg)

        async def replies() -> AsyncIterator[UserReply]:
            yield first
            if not first.finished:
                async for r in stream:
                    yield r

        if not req.stream:
            ids, text, last = [], "", first
            async for r in replies():
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
            async for r in replies():
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

    return app
