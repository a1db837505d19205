"""OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/generate (native: token ids), /health and /stats; extensions add theirs (`routes`)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.core import SamplingParams
from minisgl.extension import ChatShaping, ExtensionMissing, extensions
from minisgl.message import TokenizeMsg, UserReply
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.server.gate import Gate
from minisgl.server.protocol import (
    APIError,
    ChatRequest,
    ChoiceShaper,
    CompletionRequest,
    ExtensionFields,
    GenerateRequest,
    SamplingFields,
    StreamOptions,
    chat_max_tokens,
    chat_messages,
    check_extras,
    completion_sources,
    error_body,
    error_response,
    native_fields,
    refused_field,
    request_extensions,
    sampling_params,
)
from minisgl.utils.procs import freeze_startup_heap

# a response's tagged replies to come (Frontend.batches), and each choice's replies so far
Started = tuple[AsyncGenerator[list[tuple[int, UserReply]], None], list[list[UserReply]]]


async def api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)


async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    err = e.errors()[0] if e.errors() else {}
    loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
    if err.get("type") == "json_invalid":
        return error_response(400, "request body is not valid JSON")
    return error_response(400, f"{loc or 'body'}: {err.get('msg', 'invalid')}", loc or None)


async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    headers = dict(e.headers) if e.headers else None  # a 405's Allow
    return error_response(e.status_code, str(e.detail), headers=headers)


def error_event(e: APIError) -> str:
    return f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"


# Characters JSON leaves as they are but str.splitlines (so httpx's `iter_lines`) ends lines at:
# escaped in events, so that a stream splits only at the events' own line ends.
_LINE_ENDS = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def one_line(text: str) -> str:
    """JSON `text` with those characters escaped (the same JSON value)."""
    if "\x85" in text or "\u2028" in text or "\u2029" in text:
        return text.translate(_LINE_ENDS)
    return text


def sse(body: dict[str, Any]) -> str:
    return f"data: {one_line(json.dumps(body, ensure_ascii=False))}\n\n"


class Chunks:
    """A stream's chunks: `sse({**head, "choices": [choice]})` (ext/perf's: the same, faster)."""

    def __init__(self, head: dict[str, Any], shape: Shape) -> None:
        self.head, self.shape = head, shape

    def __call__(self, choice: dict[str, Any], usage: dict[str, int] | None = None) -> str:
        return sse({**self.head, "choices": [choice]} | ({} if usage is None else {"usage": usage}))

    def delta(self, index: int, text: str, reason: str | None, matched: str | None) -> str:
        """Choice `index`'s stream chunk for its next `text` (ext/perf's formats a plain one)."""
        return self(self.shape.choice(index, text, reason, matched, delta=True))


def token_counts(prompt: int, completion: int) -> dict[str, int]:
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def usage(first: list[UserReply], last: list[UserReply], n: int) -> dict[str, Any]:
    """OpenAI's usage of choices whose first and last replies these are (choice k * n + j: prompt
    k's j-th sample): each prompt once, every completion, the cached prompt tokens (the first's)."""
    counts = token_counts(
        sum(r.prompt_tokens for r in last[::n]), sum(r.completion_tokens for r in last)
    )
    cached = sum(r.cached_tokens or 0 for r in first[::n])
    return counts | {"prompt_tokens_details": {"cached_tokens": cached}}


async def tagged(started: Started) -> AsyncGenerator[list[tuple[int, UserReply]], None]:
    """The replies of started choices (`Frontend.batches`): those so far, then as they come."""
    batches, so_far = started
    async with aclosing(batches):
        yield [(i, r) for i, replies in enumerate(so_far) for r in replies]
        async for batch in batches:
            yield batch


@dataclass
class Shape:
    """What a response's choices look like: chat or text, n samples per prompt; shaped by
    `shaping` (tool calls, reasoning) and `shapers` (e.g. logprobs, the echo)."""

    chat: bool
    n: int
    shaping: ChatShaping | None = None
    shapers: list[ChoiceShaper] = field(default_factory=list)

    def add(self, index: int, r: UserReply) -> str:
        """Choice `index`'s next reply: its text (as the shapers leave it)."""
        for shaper in self.shapers:
            shaper.add(index, r)
        return r.text_delta

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        matched: str | None = None,
        delta: bool = False,
    ) -> dict[str, Any]:
        """The choice's text so far (whole, or a stream's `delta`), its extensions' fields and
        vLLM's `stop_reason`: the stop string that `matched`."""
        body: dict[str, Any]
        if not self.chat:
            body = {"text": text}
        elif self.shaping is not None and delta:
            shaped, finish_reason = self.shaping.delta(index, text, finish_reason)
            body = {"delta": shaped}
        elif self.shaping is not None:
            message, finish_reason = self.shaping.message(text, finish_reason)
            body = {"message": message}
        elif delta:
            body = {"delta": {"content": text} if text else {}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        choice = {"index": index, **body, "logprobs": None, "finish_reason": finish_reason}
        if matched is not None:
            choice["stop_reason"] = matched
        return choice | self.fields(index)

    def fields(self, index: int) -> dict[str, Any]:
        """The extensions' fields of choice `index` (for the replies added since the last)."""
        return {k: v for shaper in self.shapers for k, v in shaper.fields(index).items()}


class ApiServer:
    """The endpoints' work: admission, every choice's request, the replies as JSON or as SSE."""

    def __init__(self, frontend: Frontend, args: ServerArgs, max_seq_len: int) -> None:
        self.frontend, self.args, self.max_seq_len = frontend, args, max_seq_len
        path = args.engine.model or ""
        self.model_name = args.served_model_name or path  # what /v1/models lists
        self.served = {self.model_name, path, path.rstrip("/").split("/")[-1]}
        self.adapters: dict[str, dict[str, Any]] = {}  # ext/lora's: name -> its card's fields

    def check_model(self, name: str | None) -> None:
        """404 unless `model` names the model or a LoRA adapter served (which then runs it)."""
        if name is not None and name not in self.served and name not in self.adapters:
            served = ", ".join(repr(n) for n in [self.model_name, *self.adapters])
            message = f"model {name!r} does not exist; this server serves {served}"
            raise APIError(404, message, "model", "model_not_found")

    def reply_error(self, r: UserReply, first: bool) -> APIError:
        """The HTTP error for a reply that ended its request with an error."""
        message = r.error or "request failed"
        if r.finish_reason == "timeout":
            return APIError(504, message, code="timeout")
        if self.frontend.dead:
            return APIError(503, message, code="server_unavailable")
        # a first reply's error is a refusal (bad prompt...); a later one is the server's fault
        return APIError(400, message, refused_field(message)) if first else APIError(500, message)

    async def start_choices(self, msgs: list[TokenizeMsg]) -> Started:
        """Start each choice's request and wait for its first reply: a refusal is an HTTP error."""
        self.frontend.admit()
        batches, so_far = self.frontend.batches(msgs), [list[UserReply]() for _ in msgs]
        try:
            while not all(so_far):
                for i, r in await batches.__anext__():
                    if not so_far[i] and r.error is not None:
                        raise self.reply_error(r, first=True)
                    so_far[i].append(r)
        except BaseException:
            await batches.aclose()
            raise
        return batches, so_far

    def make_msgs(
        self,
        req: SamplingFields,
        params: SamplingParams,
        given: bool,
        taken: list[ExtensionFields],
        **source: Any,
    ) -> list[TokenizeMsg]:
        """One message per choice, sample j seeded seed + j, as the extensions' fields set them;
        `given`: the client set max_tokens (a prompt plus it longer than the context is refused)."""
        skip_special_tokens = source.pop("skip_special_tokens", req.skip_special_tokens)
        ids = source.get("input_ids") or []
        if any(not 0 <= t < 2**31 for t in ids):  # the detokenizer could not even decode them
            raise APIError(400, "prompt token ids must be in [0, 2**31)", "prompt")
        msgs = [
            TokenizeMsg(
                self.frontend.new_uid(),
                params=params.for_sample(j),
                skip_special_tokens=skip_special_tokens,
                context_len=self.max_seq_len if given else None,
                max_seq_len=self.max_seq_len,
                **source,
            )
            for j in range(req.n)
        ]
        for fields in taken:
            fields.apply(msgs, self.args)
        for check in extensions().request_checks:  # the choices differ in their seeds only
            check(msgs[0])
        return msgs

    async def complete(self, req: CompletionRequest) -> Any:
        self.check_model(req.model)
        taken = request_extensions(req, "/v1/completions")
        params = sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, taken)
        given = req.max_tokens is not None
        # choice k * n + j: prompt k's j-th sample (OpenAI's order)
        sources = completion_sources(req)
        msgs = [m for s in sources for m in self.make_msgs(req, params, given, taken, **s)]
        shape = Shape(False, req.n, shapers=await shapers(taken, False, msgs, self))
        return await self.respond(req, msgs, shape)

    async def chat_complete(self, req: ChatRequest) -> Any:
        self.check_model(req.model)
        taken = request_extensions(req, "/v1/chat/completions")
        max_tokens = chat_max_tokens(req)
        limit = self.max_seq_len if max_tokens is None else max_tokens  # unset: up to the context
        chat = chat_messages(req.messages)
        tools, shaping = None, None
        if (features := extensions().chat_features) is not None:  # else their fields: refused
            tools, shaping = await features.shape_chat(req, chat, self)  # tool calls, reasoning
        source: dict[str, Any] = dict(text=None, input_ids=None, chat=chat, tools=tools)
        source["chat_template_kwargs"] = req.chat_template_kwargs
        if shaping is not None and shaping.keep_special_tokens:
            source["skip_special_tokens"] = False  # the tool format's tags are special tokens
        params = sampling_params(req, limit, taken)
        msgs = self.make_msgs(req, params, max_tokens is not None, taken, **source)
        if shaping is not None:  # forced calls; a constraint held off until the reasoning ends
            for msg in msgs:
                msg.params = shaping.constrain(msg.params)
        shape = Shape(True, req.n, shaping=shaping, shapers=await shapers(taken, True, msgs, self))
        return await self.respond(req, msgs, shape)

    async def respond(self, req: SamplingFields, msgs: list[TokenizeMsg], shape: Shape) -> Any:
        options = req.stream_options or StreamOptions()
        if options.continuous_usage_stats and not options.include_usage:
            message = "stream_options.continuous_usage_stats needs include_usage true"
            raise APIError(400, message, "stream_options.continuous_usage_stats")
        started = await self.start_choices(msgs)
        head = {
            "id": f"{'chatcmpl' if shape.chat else 'cmpl'}-{msgs[0].uid}",
            "object": "text_completion",
            "created": int(time.time()),
            # vLLM's: the adapter's name
            "model": msgs[0].params.get("lora_name") or self.model_name,
        }
        if shape.chat:
            head["object"] = "chat.completion.chunk" if req.stream else "chat.completion"
        if req.stream:
            events = self.events(started, head, shape, options)
            return StreamingResponse(events, media_type="text/event-stream")
        texts, _, last = await self.collect(started, shape)
        choices = [
            shape.choice(i, text, r.finish_reason, r.matched)
            for i, (text, r) in enumerate(zip(texts, last))
        ]
        first = [replies[0] for replies in started[1]]
        return {**head, "choices": choices, "usage": usage(first, last, shape.n)}

    async def collect(
        self, started: Started, shape: Shape
    ) -> tuple[list[str], list[list[int]], list[UserReply]]:
        """Every choice's text, token ids and last reply, once all have finished."""
        texts, ids = [""] * len(started[1]), [list[int]() for _ in started[1]]
        last = [replies[-1] for replies in started[1]]
        async with aclosing(tagged(started)) as batches:
            async for batch in batches:
                for i, r in batch:
                    if r.error is not None:
                        raise self.reply_error(r, first=False)
                    texts[i] += shape.add(i, r)
                    ids[i] += r.token_ids
                    last[i] = r
        return texts, ids, last

    async def stream(
        self,
        started: Started,
        shape: Shape,
        event: Callable[[int, UserReply, str], str | None],
        opening: str = "",
        closing: Callable[[], str] = str,
    ) -> AsyncIterator[str]:
        """Server-sent events: `opening`, `event(choice, reply, its text)` of each reply (the
        replies that came together in one write), `closing()` and [DONE]. A reply's error ends
        it with an error event: the client sees an error, not a truncated answer."""
        if opening:
            yield opening
        async with aclosing(tagged(started)) as batches:
            async for batch in batches:
                events: list[str] = []
                for i, r in batch:
                    if r.error is not None:
                        yield "".join(events) + error_event(self.reply_error(r, first=False))
                        return
                    if (text := event(i, r, shape.add(i, r))) is not None:
                        events.append(text)
                if events:
                    yield "".join(events)
        yield closing() + "data: [DONE]\n\n"

    def events(
        self, started: Started, head: dict[str, Any], shape: Shape, options: StreamOptions
    ) -> AsyncIterator[str]:
        """OpenAI's chunks: a chat's roles first, then one per reply with text or a finish
        (with `continuous_usage_stats`, its choice's usage so far), the usage last if asked."""
        # (continuous usage comes with include_usage: `respond` refuses it alone)
        include_usage, continuous = options.include_usage, options.continuous_usage_stats
        first = [replies[0] for replies in started[1]]
        last = list(first)
        chunk: Chunks = (extensions().stream_chunks or Chunks)(head, shape)

        def event(i: int, r: UserReply, text: str) -> str | None:
            last[i], reason = r, r.finish_reason if r.finished else None
            if not text and not r.token_ids and reason is None:
                return None
            if not continuous:
                return chunk.delta(i, text, reason, r.matched)
            counts = token_counts(r.prompt_tokens, r.completion_tokens)
            return chunk(shape.choice(i, text, reason, r.matched, delta=True), counts)

        def closing() -> str:
            if not include_usage:
                return ""
            return sse({**head, "choices": [], "usage": usage(first, last, shape.n)})

        opening = ""
        if shape.chat:  # every choice's role; with continuous usage, the prompts' tokens
            role = {"role": "assistant", "content": ""}
            choices = [
                {"index": i, "delta": role, "finish_reason": None} for i in range(len(first))
            ]
            prompts = token_counts(sum(r.prompt_tokens for r in first[:: shape.n]), 0)
            opening = sse({**head, "choices": choices} | ({"usage": prompts} if continuous else {}))
        return self.stream(started, shape, event, opening, closing)

    async def generate(self, req: GenerateRequest) -> Any:
        """The native API: token ids in and out, one choice."""
        self.check_model(req.model)
        fields, max_tokens = native_fields(req)
        fields.model = req.model  # the LoRA adapter it names
        check_extras(dict(req.model_extra or {}), "/generate")  # SGLang's (the serving extension)
        taken = request_extensions(fields, "/generate", "/generate sampling_params")
        params = sampling_params(fields, max_tokens, taken)
        source = dict(text=req.text, input_ids=req.input_ids, chat=None)
        msgs = self.make_msgs(fields, params, False, taken, **source)  # SGLang's: to the context
        # e.g. SGLang's meta_info
        shape = Shape(False, 1, shapers=await shapers(taken, False, msgs, self))
        started = await self.start_choices(msgs)

        def event(_: int, r: UserReply, text: str) -> str:
            body = {"token_ids": r.token_ids, "text": text, "finished": r.finished}
            return sse(body | {"finish_reason": r.finish_reason} | shape.fields(0))

        if req.stream:
            events = self.stream(started, shape, event)
            return StreamingResponse(events, media_type="text/event-stream")
        texts, ids, (r,) = await self.collect(started, shape)
        body = {"output_ids": ids[0], "text": texts[0], "finish_reason": r.finish_reason}
        counts = {"prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens}
        return body | counts | shape.fields(0)

    async def stats(self) -> dict[str, Any]:
        """The scheduler's last snapshot, and this API process's requests in flight and queued."""
        counts = {"in_flight": len(self.frontend.requests), "queued": self.frontend.num_queued}
        return vars(self.frontend.stats) | counts

    async def health(self, generate: bool = False) -> JSONResponse:
        """200 while the pipeline is up (`generate`, SGLang's, is the serving extension's)."""
        if self.frontend.dead:
            return error_response(503, self.frontend.dead, code="server_unavailable")
        if generate:
            raise APIError(400, str(ExtensionMissing("generate", "serving")), "generate")
        return JSONResponse({"status": "ok"})

    async def models(self) -> dict[str, Any]:
        card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "minisgl"}
        card["max_model_len"] = self.max_seq_len  # vLLM's (ext/serving adds the vocab_size)
        loras = [{**card, "id": name, **fields} for name, fields in self.adapters.items()]
        return {"object": "list", "data": [card, *loras]}


async def shapers(
    taken: list[ExtensionFields], chat: bool, msgs: list[TokenizeMsg], api: ApiServer
) -> list[ChoiceShaper]:
    """What the request's extension fields add to its choices."""
    made = [await fields.shaper(chat, msgs, api) for fields in taken]
    return [shaper for shaper in made if shaper is not None]


def create_app(frontend: Frontend, args: ServerArgs, info: dict[str, Any]) -> FastAPI:
    """The app; `info`: what the schedulers reported once ready (max_seq_len, /server_info's)."""
    # the heap is frozen once the app is built and the backends ready: only serving's objects are
    # left for the garbage collector's full collections to walk
    app = FastAPI(title="minisgl", on_startup=[frontend.start, freeze_startup_heap])
    api = ApiServer(frontend, args, info["max_seq_len"])
    app.exception_handler(APIError)(api_error)
    app.exception_handler(RequestValidationError)(validation_error)
    app.exception_handler(StarletteHTTPException)(http_error)
    for add_routes in extensions().routes:  # first: e.g. the serving extension's /health
        add_routes(app, api, info)
    app.get("/health")(api.health)
    app.get("/stats")(api.stats)
    app.get("/v1/models")(api.models)
    # ext/serving serves these ahead: a plain (not streamed) response stops when its client leaves
    app.post("/v1/completions")(api.complete)
    app.post("/v1/chat/completions")(api.chat_complete)
    app.post("/generate")(api.generate)
    paths = frozenset(getattr(r, "path", "") for r in app.routes)
    gate = extensions().gate or Gate  # the serving extension's limits requests in progress
    app.add_middleware(gate, args=args, frontend=frontend, paths=paths)
    return app
