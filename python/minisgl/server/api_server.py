"""OpenAI-compatible HTTP API (FastAPI): /v1/chat/completions, /v1/completions, /v1/models,
/generate (native, token ids), /tokenize and /detokenize (vLLM's), /health, /stats and /metrics
(Prometheus)."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import threading
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from json.encoder import encode_basestring
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from minisgl.core import SamplingParams
from minisgl.message import ApiViewMsg, TokenizeMsg, UserReply
from minisgl.parsers import (
    FunctionSchema,
    OutputParser,
    OutputStream,
    StreamDelta,
    ToolChoice,
    ToolSpecError,
    get_reasoning_parser,
    get_tool_parser,
    parse_tools,
)
from minisgl.server.args import ServerArgs
from minisgl.server.frontend import Frontend
from minisgl.server.limits import MAX_GRAMMAR_CHARS, check_limits
from minisgl.server.logprobs import CompletionLogprobs, chat_logprobs
from minisgl.server.metrics import CONTENT_TYPE
from minisgl.server.protocol import (
    COMPLETION_NOT_SUPPORTED,
    NOT_SUPPORTED,
    APIError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    OpenAIRequest,
    SamplingFields,
    TokenizeRequest,
    chat_max_tokens,
    chat_messages,
    chat_tools,
    completion_sources,
    error_body,
    error_response,
    extra_fields,
    native_sampling_fields,
    sampling_params,
)
from minisgl.server.sglang_compat import add_sglang_routes, check_generate_extras
from minisgl.tokenizer.server import encode_chat, load_chat_tokenizer, needed, render_chat
from minisgl.utils.procs import freeze_startup_heap

logger = logging.getLogger(__name__)
T = TypeVar("T")

DISCONNECT_POLL_S = 0.2  # how often a non-streamed request checks that its client is still there
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by anyone
# one request's batches of replies (Frontend.batches), and its first batch (already taken)
Started = tuple[AsyncGenerator[list[UserReply], None], list[UserReply]]
Tagged = list[tuple[int, UserReply]]  # replies of a response's choices, by choice index


# a JSON \u escape of a UTF-16 surrogate: the one way a JSON body can carry text that is not
# valid Unicode (raw surrogate bytes are invalid UTF-8, which the JSON parser refuses). A pair
# (an emoji, as ASCII-only encoders write it) matches too: only the walk tells them apart. A
# plain pattern: one with lookarounds to find lone ones takes ~25 ms per MB.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _valid_text(text: str) -> bool:
    try:
        text.encode()  # in C: a lone surrogate fails
        return True
    except UnicodeEncodeError:
        return False


def invalid_text_path(body: bytes) -> str | None:
    """Where a JSON body holds text that is not valid Unicode, as a field path (e.g.
    `messages[0].content`), or None. Only a body with a surrogate escape is parsed here (a pair,
    or an escaped backslash before `ud800`, is a false alarm the walk clears); one that is not
    JSON is left to FastAPI, which says so."""
    if not SURROGATE_ESCAPE.search(body):
        return None
    try:
        todo: list[tuple[str, Any]] = [("body", json.loads(body))]
    except (ValueError, RecursionError):
        return None
    while todo:  # depth first, in document order, without recursion (the nesting is the client's)
        path, value = todo.pop()
        if isinstance(value, str) and not _valid_text(value):
            return path
        if isinstance(value, dict):
            children = [(k if path == "body" else f"{path}.{k}", v) for k, v in value.items()]
            for name, _ in children:
                if not _valid_text(name):  # a field name, shown with its surrogate escaped
                    return name.encode("utf-8", "backslashreplace").decode()
        elif isinstance(value, list):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        todo.extend(reversed(children))
    return None


class Gate:
    """What every HTTP request passes before FastAPI: the API key, the body size limit, text
    that is not valid Unicode, and the count of responses by status. An exception the app did
    not turn into a response becomes an OpenAI-shaped JSON 500 here, so that it is counted too.
    Pure ASGI (not BaseHTTPMiddleware), so that an endpoint still sees its client disconnect;
    the body is read whole here and replayed to the app."""

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
        started = False

        async def counted(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.statuses.labels(path, str(message["status"])).inc()
            await send(message)

        async def refuse(status: int, message: str, code: str, param: str | None = None) -> None:
            await error_response(status, message, param, code)(scope, receive, counted)

        headers = dict(scope["headers"])
        if self.api_key and scope["path"] != "/health":
            given = headers.get(b"authorization", b"")
            if not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                return await refuse(401, "invalid or missing API key", "invalid_api_key")
        too_large = f"request body is larger than {self.max_body} bytes"
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_body:
            return await refuse(413, too_large, "body_too_large")
        body = await self.read_body(receive)
        if body is None:
            return  # the client left before sending all of its body
        if len(body) > self.max_body:  # no (or a false) Content-Length
            return await refuse(413, too_large, "body_too_large")
        if (where := invalid_text_path(body)) is not None:
            message = f"{where}: text is not valid Unicode (a lone UTF-16 surrogate)"
            return await refuse(400, message, "invalid_unicode", where)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: the client's disconnect
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        try:
            await self.app(scope, replay, counted)
        except Exception as e:
            if started:  # too late for a status: the connection is cut (uvicorn logs it)
                raise
            logger.exception("%s %s failed", scope["method"], scope["path"])
            message = f"internal server error ({type(e).__name__}); see the server log"
            await refuse(500, message, "internal_error")

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


async def api_error(_: Request, e: APIError) -> JSONResponse:
    return error_response(e.status, e.message, e.param, e.code, e.headers)


async def validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
    err = e.errors()[0] if e.errors() else {}
    loc = [str(x) for x in err.get("loc", ()) if x != "body"]
    if err.get("type") == "json_invalid":
        return error_response(400, "request body is not valid JSON")
    return error_response(
        400, f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid')}", ".".join(loc) or None
    )


async def http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    headers = dict(e.headers) if e.headers else None  # a 405's Allow
    return error_response(e.status_code, str(e.detail), headers=headers)


def error_event(e: APIError) -> str:
    return f"data: {json.dumps(error_body(e.status, e.message, e.param, e.code))}\n\n"


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


class Chunks:
    """`sse({**head, "choices": [choice]})` for one choice, byte for byte, with the head
    encoded once per response instead of once per token."""

    def __init__(self, head: dict[str, Any], chat: bool) -> None:
        self.prefix = sse({**head, "choices": []})[:-4]  # without ']}' and the blank line
        self.chat = chat

    def __call__(self, choice: dict[str, Any]) -> str:
        return f"{self.prefix}{json.dumps(choice, ensure_ascii=False)}]}}\n\n"

    def plain(self, index: int, text: str, finish_reason: str | None) -> str:
        """The chunk of a choice without logprobs or a parser (`Shape.choice`'s, encoded), as
        one format: a stream's per-token work, where building and encoding the dict took ~4 us
        of the API process's ~40 per token."""
        reason = "null" if finish_reason is None else encode_basestring(finish_reason)
        if not self.chat:
            body = f'"text": {encode_basestring(text)}'
        else:
            body = f'"delta": {{"content": {encode_basestring(text)}}}' if text else '"delta": {}'
        choice = f'{{"index": {index}, {body}, "logprobs": null, "finish_reason": {reason}}}'
        return f"{self.prefix}{choice}]}}\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    total = prompt + completion
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": total}


def text_choice(
    index: int, text: str, finish_reason: str | None, logprobs: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


async def merged(started: list[Started]) -> AsyncGenerator[Tagged, None]:
    """Replies of all choices as they come, tagged with the choice index: each time all that
    have come, so that a handler that fell behind writes them at once."""
    if len(started) == 1:  # one choice: its batches as they are, without a pump task
        stream, first = started[0]
        try:
            yield [(0, r) for r in first]
            if not first[-1].finished:
                async for batch in stream:
                    yield [(0, r) for r in batch]
        finally:
            await stream.aclose()
        return
    queue: asyncio.Queue[tuple[int, list[UserReply]]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[list[UserReply]], first: list[UserReply]) -> None:
        queue.put_nowait((i, first))
        if not first[-1].finished:
            async for batch in stream:
                queue.put_nowait((i, batch))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(started)]
    try:
        done = 0
        while done < len(tasks):
            ready = [await queue.get()]
            while not queue.empty():
                ready.append(queue.get_nowait())
            tagged = [(i, r) for i, batch in ready for r in batch]
            done += sum(r.finished for _, r in tagged)
            yield tagged
    finally:
        for t in tasks:
            t.cancel()
        # a stream must be left by its pump before it can be closed here
        await asyncio.gather(*tasks, return_exceptions=True)
        for s, _ in started:
            await s.aclose()


@dataclass
class ChatParsing:
    """How a chat response's text becomes content, reasoning_content and tool_calls, and what
    constrains it: `choice` None parses no tool calls; `in_reasoning`: the prompt opened the
    reasoning (True), closed it (False: thinking off) or neither (None); `parallel` false keeps
    the first call only (and a forced call is one call); `forced`: the request's functions when
    its tool_choice (or legacy function_call: `choice_param`) forces calls;
    `keep_special_tokens`: the tool format's tags are special tokens, so the response is
    detokenized with them; `strip`: then the special tokens (EOS) removed from the end of a
    stopped response. `legacy`: the request gave `functions`, so the reply has the legacy
    shape (one `function_call`, finish_reason "function_call") as OpenAI's deprecated API."""

    parser: OutputParser
    choice: ToolChoice | None
    in_reasoning: bool | None
    parallel: bool = True
    keep_special_tokens: bool = False
    strip: tuple[str, ...] = ()
    forced: list[FunctionSchema] = field(default_factory=list)
    choice_param: str = "tool_choice"
    legacy: bool = False

    def constrain(self, params: SamplingParams, any_whitespace: bool) -> SamplingParams:
        """A choice's params with the grammar of its forced calls, or with its output
        constraint moved after the reasoning (OutputParser.constrain)."""
        forced = None
        if self.forced and self.choice is not None:
            forced = (self.forced, self.choice, self.parallel)
        try:
            params = self.parser.constrain(params, forced, self.in_reasoning, any_whitespace)
        except ValueError as e:
            message = str(e).replace("tool_choice", self.choice_param, 1)
            raise APIError(400, message, self.choice_param if forced else None) from None
        grammar = params.structural_tag or ""
        if forced and len(grammar) > MAX_GRAMMAR_CHARS:  # the tools' schemas, compiled
            message = (
                f"tools: the grammar of the forced calls has at most {MAX_GRAMMAR_CHARS} "
                f"characters, got {len(grammar)} (its compilation would hold up other requests)"
            )
            raise APIError(400, message, "tools", "limit_exceeded")
        return params

    def stream(self) -> OutputStream:
        return self.parser.stream(self.choice, self.in_reasoning)

    def final_text(self, text: str, finish_reason: str | None) -> str:
        if finish_reason == "stop":
            for token in self.strip:
                if token and text.endswith(token):
                    return text[: -len(token)]
        return text

    def finish(self, finish_reason: str | None, called: bool) -> str | None:
        if not called or finish_reason != "stop":
            return finish_reason
        return "function_call" if self.legacy else "tool_calls"

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole response's message, and its finish_reason."""
        parsed = self.parser.parse(
            self.final_text(text, finish_reason), self.choice, self.in_reasoning
        )
        calls = parsed.tool_calls if self.parallel else parsed.tool_calls[:1]
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if self.parser.reasoning is not None:
            message["reasoning_content"] = parsed.reasoning
        if calls and self.legacy:
            message["function_call"] = calls[0].to_openai()["function"]
        elif calls:
            message["tool_calls"] = [call.to_openai() for call in calls]
        return message, self.finish(finish_reason, bool(calls))

    def delta(
        self, stream: OutputStream, text: str, finish_reason: str | None
    ) -> tuple[dict[str, Any], str | None]:
        """A stream chunk's delta for the next piece of text (the last piece: `finish_reason`
        set, which flushes what the parsers held back), and its finish_reason."""
        piece = stream.feed(self.final_text(text, finish_reason)) if text else StreamDelta()
        if finish_reason is not None:
            piece.extend(stream.finish())
        delta: dict[str, Any] = {}
        if piece.content:
            delta["content"] = piece.content
        if piece.reasoning:
            delta["reasoning_content"] = piece.reasoning
        calls = [c.to_openai() for c in piece.tool_calls if self.parallel or c.index == 0]
        if calls and self.legacy:
            delta["function_call"] = calls[0]["function"]
        elif calls:
            delta["tool_calls"] = calls
        return delta, self.finish(finish_reason, stream.has_tool_calls)


@dataclass
class Shape:
    """What a response's choices look like: chat or text, with logprobs, after an echoed prompt
    (completions), for n samples per prompt; a chat's text parsed by `parsing` (if set)."""

    chat: bool
    logprobs: bool
    echo: list[str] | None
    n: int
    parsing: ChatParsing | None = None
    streams: dict[int, OutputStream] = field(default_factory=dict)  # per choice, streamed

    def entries(self, r: UserReply) -> list[list[Any]]:
        """The reply's log-probability entries: an echoed prompt's first (the first reply)."""
        prompt = r.prompt_logprobs if self.echo is not None else None
        return (prompt or []) + (r.logprobs or [])

    def choice(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        entries: list[list[Any]],
        legacy: CompletionLogprobs,
        delta: bool = False,
    ) -> dict[str, Any]:
        if not self.chat:
            return text_choice(
                index, text, finish_reason, legacy.add(entries) if self.logprobs else None
            )
        logprobs = chat_logprobs(entries) if self.logprobs else None
        body: dict[str, Any]
        if self.parsing is not None and delta:
            stream = self.streams.setdefault(index, self.parsing.stream())
            parsed, finish_reason = self.parsing.delta(stream, text, finish_reason)
            body = {"delta": parsed}
        elif self.parsing is not None:
            message, finish_reason = self.parsing.message(text, finish_reason)
            body = {"message": message}
        elif delta:
            body = {"delta": {"content": text} if text else {}}
        else:
            body = {"message": {"role": "assistant", "content": text}}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}


class ApiServer:
    """The endpoints' work for one app: admission, starting the requests of all choices, and
    their replies as one JSON response or as server-sent events."""

    def __init__(self, frontend: Frontend, args: ServerArgs, max_seq_len: int) -> None:
        self.frontend, self.args, self.max_seq_len = frontend, args, max_seq_len
        path = args.engine.model or ""
        self.model_name = args.served_model_name or path  # what /v1/models lists
        self.served = {self.model_name, path, path.rstrip("/").split("/")[-1]}
        self.tokenizer: list[
            Any
        ] = []  # /tokenize's, loaded on first use (None: the model has none)
        self.tokenizer_lock = threading.Lock()
        self.parser: OutputParser | None = None  # --tool-call-parser's and --reasoning-parser's
        self.special_tokens: tuple[str, ...] = ()  # the tokenizer's, when the parser keeps some
        self.health_check: asyncio.Future[str | None] | None = None  # /health?generate=1's

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {self.model_name!r}",
                "model",
                "model_not_found",
            )

    def reply_error(self, r: UserReply, first: bool) -> APIError:
        """The HTTP error for a reply that ended its request with an error."""
        message = r.error or "request failed"
        if r.finish_reason == "timeout":
            return APIError(504, message, code="timeout")
        if self.frontend.dead:
            return APIError(503, message, code="server_unavailable")
        # a first reply's error is a refusal (bad prompt...); a later one is the server's fault
        return APIError(400 if first else 500, message)

    def admit(self, num: int) -> None:
        """Refuse new work when the pipeline is dead or too many requests wait to start."""
        if self.frontend.dead:
            reason = f"server is shutting down: {self.frontend.dead}"
            raise APIError(503, reason, code="server_unavailable")
        limit, queued = self.args.max_queued_requests, self.frontend.num_queued
        if limit is not None:  # each API process admits its share
            limit = -(-limit // self.frontend.api_count)
        if limit is not None and queued >= limit:
            raise APIError(
                503,
                f"server overloaded: {queued} requests are waiting to start (limit {limit}); retry later",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    async def first_reply(self, msg: TokenizeMsg) -> Started:
        """Start a request and wait for its first reply, so refusals become HTTP errors."""
        stream = self.frontend.batches(msg, self.args.request_timeout)
        first = await stream.__anext__()
        if first[0].error is not None:
            await stream.aclose()
            raise self.reply_error(first[0], first=True)
        return stream, first

    async def start_choices(self, msgs: list[TokenizeMsg]) -> list[Started]:
        self.admit(len(msgs))
        started: list[Started] = []
        try:
            for m in msgs:
                started.append(await self.first_reply(m))
        except BaseException:
            for stream, _ in started:
                await stream.aclose()
            raise
        return started

    def check_fields(self, req: OpenAIRequest, not_supported: dict[str, str], path: str) -> None:
        """Refuse what is not supported; warn once per request about fields ignored (vLLM's way)."""
        self.check_model(req.model)
        ignored = extra_fields(req, not_supported)
        if ignored:
            logger.warning("%s: ignoring unknown fields %s", path, ", ".join(map(repr, ignored)))

    def make_msgs(
        self,
        req: SamplingFields,
        max_tokens: int,
        given: bool,
        logprobs: dict[str, Any] | None = None,
        **source: Any,
    ) -> list[TokenizeMsg]:
        """One message per choice; `given`: the client set max_tokens, so that a prompt plus
        max_tokens longer than the context is refused (by the tokenizer worker, which counts);
        `logprobs`: sampling_params' logprobs, prompt_logprobs and echo."""
        skip_special_tokens = source.pop("skip_special_tokens", req.skip_special_tokens)
        ids = source.get("input_ids") or []
        if any(not 0 <= t < 2**31 for t in ids):  # the detokenizer could not even decode them
            raise APIError(400, "prompt token ids must be in [0, 2**31)", "prompt")
        msgs = [
            TokenizeMsg(
                self.frontend.new_uid(),
                params=sampling_params(req, max_tokens, i, **(logprobs or {})),
                skip_special_tokens=skip_special_tokens,
                context_len=self.max_seq_len if given else None,
                max_seq_len=self.max_seq_len,
                **source,
            )
            for i in range(req.n)
        ]
        check_limits(msgs[0].params, source.get("chat"))  # the choices differ in their seeds only
        return msgs

    async def complete(self, req: CompletionRequest) -> Any:
        self.check_fields(req, COMPLETION_NOT_SUPPORTED, "/v1/completions")
        given = req.max_tokens is not None and "max_tokens" in req.model_fields_set
        max_tokens = req.max_tokens if req.max_tokens is not None else 16
        sources = completion_sources(req)
        # echo with logprobs: the prompt's too (none predicts its first token: null)
        scored = req.logprobs if req.echo else None
        lp = dict(logprobs=req.logprobs, prompt_logprobs=scored, echo=req.echo)
        # choice k * n + j: prompt k's j-th sample (OpenAI's order)
        msgs = [
            msg
            for source in sources
            for msg in self.make_msgs(req, max_tokens, given, lp, **source)
        ]
        echo = None
        if req.echo:
            texts = [await self.prompt_text(source) for source in sources]
            echo = [text for text in texts for _ in range(req.n)]
        return await self.respond(req, msgs, chat=False, echo=echo)

    async def prompt_text(self, source: dict[str, Any]) -> str:
        """What `echo` puts before the completion: the prompt as given, token ids decoded."""
        if source["text"] is not None:
            return source["text"]
        ids = source["input_ids"]
        return await self.with_tokenizer(lambda tok: needed(tok).decode(ids), "prompt")

    async def chat_complete(self, req: ChatRequest) -> Any:
        self.check_fields(req, NOT_SUPPORTED, "/v1/chat/completions")
        max_tokens = chat_max_tokens(req)
        limit = self.max_seq_len if max_tokens is None else max_tokens  # unset: up to the context
        chat = chat_messages(req.messages)
        functions, choice = chat_tools(req)
        kwargs = req.chat_template_kwargs
        tools = [f.to_openai_tool() for f in functions] or None
        render = lambda tok: render_chat(tok, chat, kwargs, True, tools)  # noqa: E731
        parsing = await self.chat_parsing(req, functions, choice, render)
        source: dict[str, Any] = dict(text=None, input_ids=None, chat=chat, tools=tools)
        source["chat_template_kwargs"] = kwargs
        if parsing is not None and parsing.keep_special_tokens:
            source["skip_special_tokens"] = False  # the tool format's tags are special tokens
        lp = dict(logprobs=req.logprobs_k())
        msgs = self.make_msgs(req, limit, max_tokens is not None, lp, **source)
        if parsing is not None:  # forced calls; a constraint held off until the reasoning ends
            any_whitespace = self.args.scheduler.json_any_whitespace
            for msg in msgs:
                msg.params = parsing.constrain(msg.params, any_whitespace)
        return await self.respond(req, msgs, chat=True, parsing=parsing)

    async def output_parser(self) -> OutputParser:
        """The server's parsers, made on first use (a tool format may look at the vocabulary)."""
        if self.parser is None:
            name, reasoning = self.args.tool_call_parser, self.args.reasoning_parser
            tools = None
            if name is not None:

                def vocabulary(tok: Any) -> tuple[set[str], tuple[str, ...]]:
                    return set(needed(tok).get_vocab()), tuple(tok.all_special_tokens)

                vocab, self.special_tokens = await self.with_tokenizer(vocabulary, "model")
                tools = get_tool_parser(name, vocab)
            self.parser = OutputParser(
                get_reasoning_parser(reasoning) if reasoning else None, tools
            )
        return self.parser

    async def chat_parsing(
        self,
        req: ChatRequest,
        functions: list[FunctionSchema],
        choice: ToolChoice,
        render: Callable[[Any], str],
    ) -> ChatParsing | None:
        """How the responses of `req` are parsed; None: returned as the raw text. `render`
        renders the prompt, whose end may open the reasoning (a template that thinks by
        default ends it with the start tag)."""
        if functions and choice.parses and self.args.tool_call_parser is None:
            param = "tools" if req.tools is not None else "functions"
            message = (
                f"{param}: this server was started without a tool call parser "
                "(--tool-call-parser), so the model's calls cannot be returned; "
                "give tool_choice 'none' to only show the tools to the model"
            )
            raise APIError(400, message, param)
        parser = await self.output_parser()
        tool_choice = choice if functions and choice.parses else None
        if parser.reasoning is None and (parser.tools is None or tool_choice is None):
            return None
        in_reasoning = None
        if parser.reasoning is not None and not parser.reasoning.starts_in_reasoning:
            prompt = await self.with_tokenizer(render, "messages")
            in_reasoning = parser.reasoning.prompt_reasoning(prompt)
        keep = tool_choice is not None and parser.tools is not None and parser.tools.special_tokens
        tags = set(parser.tools.special_tokens if parser.tools else ())
        strip = tuple(t for t in self.special_tokens if t not in tags) if keep else ()
        legacy = req.tools is None and req.functions is not None  # one call, the legacy reply
        parallel = req.parallel_tool_calls is not False and not legacy
        forced = functions if choice.mode in ("required", "named") else []
        param = "function_call" if req.function_call is not None else "tool_choice"
        return ChatParsing(
            parser, tool_choice, in_reasoning, parallel, bool(keep), strip, forced, param, legacy
        )

    async def respond(
        self,
        req: SamplingFields,
        msgs: list[TokenizeMsg],
        chat: bool,
        echo: list[str] | None = None,
        parsing: ChatParsing | None = None,
    ) -> Any:
        """`echo`: per choice, the prompt text that comes before its completion; `parsing`:
        how a chat's text is parsed (reasoning, tool calls)."""
        started = await self.start_choices(msgs)
        chunk = ".chunk" if req.stream else ""
        head = {
            "id": f"{'chatcmpl' if chat else 'cmpl'}-{msgs[0].uid}",
            "object": f"chat.completion{chunk}" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        shape = Shape(chat, msgs[0].params.logprobs is not None, echo, req.n, parsing)
        if not req.stream:
            return await self.collect(started, head, shape)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = self.events(started, head, shape, include_usage)
        return StreamingResponse(events, media_type="text/event-stream")

    async def collect(
        self, started: list[Started], head: dict[str, Any], shape: Shape
    ) -> dict[str, Any]:
        """The whole response of all choices, once every one has finished."""
        n = len(started)
        texts, prompt, completion = list(shape.echo or [""] * n), [0] * n, [0] * n
        entries: list[list[list[Any]]] = [[] for _ in range(n)]
        reasons: list[str | None] = [None] * n
        async with aclosing(merged(started)) as batches:
            async for batch in batches:
                for i, r in batch:
                    if r.error is not None:
                        raise self.reply_error(r, first=False)
                    texts[i] += r.text_delta
                    entries[i] += shape.entries(r)
                    prompt[i], completion[i] = r.prompt_tokens, r.completion_tokens
                    reasons[i] = r.finish_reason if r.finished else None
        choices = [
            shape.choice(i, text, reason, entries[i], CompletionLogprobs())
            for i, (text, reason) in enumerate(zip(texts, reasons))
        ]
        prompt_tokens = sum(prompt) // shape.n  # each prompt counted once, not per sample
        return {**head, "choices": choices, "usage": usage(prompt_tokens, sum(completion))}

    async def events(
        self, started: list[Started], head: dict[str, Any], shape: Shape, include_usage: bool
    ) -> AsyncIterator[str]:
        """Server-sent events of all choices: a chunk per reply carrying text or a finish."""
        n = len(started)
        if shape.chat:
            role = {"role": "assistant", "content": ""}
            opening = [{"index": i, "delta": role, "finish_reason": None} for i in range(n)]
            yield sse({**head, "choices": opening})
        prompt, completion = [0] * n, [0] * n
        echo, legacy = list(shape.echo or [""] * n), [CompletionLogprobs() for _ in range(n)]
        chunk, plain = Chunks(head, shape.chat), not shape.logprobs and shape.parsing is None
        async with aclosing(merged(started)) as batches:
            async for batch in batches:
                events: list[str] = []  # one write for the batch
                for i, r in batch:
                    if r.error is not None:  # the client sees an error, not a truncated answer
                        yield "".join(events) + error_event(self.reply_error(r, first=False))
                        return
                    prompt[i], completion[i] = r.prompt_tokens, r.completion_tokens
                    fr = r.finish_reason if r.finished else None
                    text, echo[i] = echo[i] + r.text_delta, ""  # the prompt goes first, once
                    entries = shape.entries(r)
                    if not text and not r.token_ids and fr is None and not entries:
                        continue
                    if plain:
                        events.append(chunk.plain(i, text, fr))
                    else:
                        choice = shape.choice(i, text, fr, entries, legacy[i], delta=True)
                        events.append(chunk(choice))
                if events:
                    yield "".join(events)
        tail = ""
        if include_usage:
            prompt_tokens = sum(prompt) // shape.n  # each prompt counted once
            tail = sse({**head, "choices": [], "usage": usage(prompt_tokens, sum(completion))})
        yield tail + "data: [DONE]\n\n"

    async def generate(self, req: GenerateRequest) -> Any:
        """The native API: token ids in and out, one choice."""
        self.check_model(req.model)
        check_generate_extras(req.model_extra or {})
        fields, max_tokens = native_sampling_fields(req)
        source = dict(text=req.text, input_ids=req.input_ids, chat=None)
        msgs = self.make_msgs(fields, max_tokens, False, None, **source)  # SGLang's: to the context
        if req.data_parallel_rank is not None:  # SGLang's: run on this --dp replica
            if not 0 <= req.data_parallel_rank < self.args.dp:
                message = f"data_parallel_rank must be in [0, {self.args.dp}) (--dp {self.args.dp})"
                raise APIError(400, message, "data_parallel_rank")
            msgs[0].dp_rank = req.data_parallel_rank
        started = await self.start_choices(msgs)
        if req.stream:
            return StreamingResponse(self.native_events(started), media_type="text/event-stream")
        ids: list[int] = []
        text, last = "", started[0][1][-1]
        async with aclosing(merged(started)) as batches:
            async for batch in batches:
                for _, r in batch:
                    if r.error is not None:
                        raise self.reply_error(r, first=False)
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

    async def native_events(self, started: list[Started]) -> AsyncIterator[str]:
        async with aclosing(merged(started)) as batches:
            async for batch in batches:
                events: list[str] = []  # one write for the batch
                for _, r in batch:
                    if r.error is not None:
                        yield "".join(events) + error_event(self.reply_error(r, first=False))
                        return
                    body = {
                        "token_ids": r.token_ids,
                        "text": r.text_delta,
                        "finished": r.finished,
                        "finish_reason": r.finish_reason,
                    }
                    events.append(sse(body))
                yield "".join(events)
        yield "data: [DONE]\n\n"

    async def with_tokenizer(self, work: Callable[[Any], T], param: str) -> T:
        """`work(tokenizer)` in a thread, with the workers' tokenizer (same files, same
        --chat-template) loaded here once; its failure is the client's (400), as in a worker.
        The load imports transformers into this process: its objects join the frozen heap."""

        def run() -> T:
            with self.tokenizer_lock:
                if not self.tokenizer:
                    from minisgl.models.weight import resolve_model_path

                    path = resolve_model_path(self.args.engine.model or "")
                    self.tokenizer.append(load_chat_tokenizer(path, self.args.chat_template))
                    freeze_startup_heap()
            return work(self.tokenizer[0])

        try:
            return await asyncio.get_running_loop().run_in_executor(None, run)
        except Exception as e:
            raise APIError(400, str(e), param) from None

    async def tokenize(self, req: TokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", "prompt")
        if req.messages is None:
            text = req.prompt
            ids = await self.with_tokenizer(lambda tok: needed(tok).encode(text), "prompt")
        else:
            chat, kwargs = chat_messages(req.messages), req.chat_template_kwargs
            try:
                tools = [f.to_openai_tool() for f in parse_tools(req.tools)] or None
            except ToolSpecError as e:
                raise APIError(400, str(e), e.param) from None
            with_prompt = req.add_generation_prompt
            encode = lambda tok: encode_chat(tok, chat, kwargs, with_prompt, tools)  # noqa: E731
            ids = await self.with_tokenizer(encode, "messages")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_seq_len}

    async def detokenize(self, req: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(req.model)

        def decode(tok: Any) -> str:
            vocab = len(needed(tok))
            if any(not 0 <= t < vocab for t in req.tokens):
                raise ValueError(f"tokens must be in [0, {vocab})")
            return tok.decode(req.tokens)

        return {"prompt": await self.with_tokenizer(decode, "tokens")}

    async def health(self, generate: bool = False) -> JSONResponse:
        """200 while the pipeline is up; with `generate`, only once a one-token generation went
        through every process within --health-check-timeout (SGLang's health_generate)."""
        if self.frontend.dead:
            return error_response(503, self.frontend.dead, code="server_unavailable")
        if generate:
            if self.health_check is None or self.health_check.done():  # probes share one
                self.health_check = asyncio.ensure_future(self.generate_one_token())
            error = await asyncio.shield(self.health_check)
            if error is not None:
                return error_response(503, error, code="server_unavailable")
        return JSONResponse({"status": "ok"})

    async def generate_one_token(self) -> str | None:
        """One greedy token from token id 0 through the tokenizer, each --dp replica's
        scheduler and the detokenizer (not counted against --max-queued-requests); None, or why
        it failed."""
        params = SamplingParams(max_tokens=1, temperature=0.0)
        timeout = self.args.health_check_timeout

        async def one(replica: int | None) -> str | None:
            msg = TokenizeMsg(self.frontend.new_uid(), None, [0], None, params, dp_rank=replica)
            where = "" if replica is None else f" (replica {replica})"
            async with aclosing(self.frontend.stream(msg, timeout)) as replies:
                async for r in replies:
                    if r.error is not None:
                        return f"health check generation failed{where}: {r.error}"
            return None

        replicas = [None] if self.args.dp == 1 else list(range(self.args.dp))
        errors = await asyncio.gather(*(one(r) for r in replicas))
        return next((e for e in errors if e is not None), None)

    async def views(self, metrics: bool = False) -> list[ApiViewMsg]:
        """Every API process's counts (`Frontend.views`); 503 when one does not answer."""
        try:
            return await self.frontend.views(metrics)
        except asyncio.TimeoutError:
            raise APIError(
                503, "an API process did not answer", code="server_unavailable"
            ) from None

    async def stats(self) -> dict[str, Any]:
        """Scheduler snapshot (running requests, KV pages), refreshed when it goes idle, plus the
        API processes' view: requests in flight and not started yet (summed over the
        --api-server-count processes, and per process), RSS of all processes."""
        views = await self.views()
        out = self.frontend.stats.__dict__ | {
            "in_flight": sum(v.in_flight for v in views),
            "queued": sum(v.queued for v in views),
            "rss_bytes": sum(v.rss_bytes for v in views),
        }
        if len(views) > 1:
            keys = ("rank", "pid", "in_flight", "queued")
            out["api_servers"] = [{k: getattr(v, k) for k in keys} for v in views]
        return out

    async def metrics(self) -> Response:
        views = await self.views(metrics=True)
        peers = [v.metrics for v in views if v.rank != self.frontend.api_rank]
        return Response(self.frontend.metrics.render(peers), media_type=CONTENT_TYPE)

    async def models(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "minisgl",
            "max_model_len": self.max_seq_len,
        }
        try:  # benchmarks draw random prompt ids below it (the tokenizer's, loaded once)
            card["vocab_size"] = await self.with_tokenizer(lambda tok: len(needed(tok)), "model")
        except APIError:
            pass  # a model without a tokenizer: no vocab_size
        return {"object": "list", "data": [card]}


ERROR_STATUSES = {
    400: "invalid request: the error names the field (FastAPI's 422 is answered 400, as OpenAI)",
    401: "missing or wrong API key (--api-key)",
    404: "the model named is not served here",
    413: "body larger than --max-request-bytes",
    500: "internal error",
    503: "overloaded (--max-queued-requests), shutting down, or a worker died or hung (the "
    "watchdog); /health?generate=1: the one-token generation failed or took too long",
    504: "the request ran past --request-timeout",
}
ERROR_SCHEMA: dict[str, Any] = {  # error_body's
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "code": {"anyOf": [{"type": "string"}, {"type": "null"}]},
            },
        }
    },
}


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})


def error_statuses(path: str, method: str) -> set[int]:
    """The error statuses an endpoint answers."""
    statuses = {500} | ({400, 503} if path == "/health" else {401})  # 400: `generate`
    if method == "post":
        statuses |= {400, 413, 404}  # 404: "model" unknown
    if path == "/flush_cache":
        statuses |= {400, 503}  # cache_busy; the pipeline is gone
    if path == "/health_generate":
        statuses |= {503}
    if path in GENERATION_PATHS:
        statuses |= {503, 504}
    return statuses


STREAMING_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/generate"})
# Before OpenAPI 3.2, a text/event-stream `schema` describes one event (its SSE fields), not the
# stream; every event minisgl sends is one `data:` line of JSON (or `[DONE]`).
SSE_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def document_errors(app: FastAPI) -> None:
    """Make the OpenAPI document say what the server answers: FastAPI documents a 422 for a
    validation error (answered 400 here) and no other error."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        components["ErrorResponse"] = ERROR_SCHEMA
        ref = {"$ref": "#/components/schemas/ErrorResponse"}
        for path, operations in schema.get("paths", {}).items():
            for method, operation in operations.items():
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                if path in STREAMING_PATHS and "200" in responses:  # with "stream": true
                    events = {"schema": SSE_EVENT_SCHEMA}
                    responses["200"].setdefault("content", {})["text/event-stream"] = events
                for status in sorted(error_statuses(path, method)):
                    content = {"application/json": {"schema": ref}}
                    responses[str(status)] = {
                        "description": ERROR_STATUSES[status],
                        "content": content,
                    }
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def create_app(
    frontend: Frontend, args: ServerArgs, max_seq_len: int, info: dict | None = None
) -> FastAPI:
    """The app; `info`: what the schedulers reported once ready (KV pages, for /server_info)."""
    # the heap is frozen once the app is built and the backends ready: only serving's objects are
    # left for the garbage collector's full collections to walk
    app = FastAPI(title="minisgl", on_startup=[frontend.start, freeze_startup_heap])
    api = ApiServer(frontend, args, max_seq_len)
    app.exception_handler(APIError)(api_error)
    app.exception_handler(RequestValidationError)(validation_error)
    app.exception_handler(StarletteHTTPException)(http_error)
    document_errors(app)
    app.get("/health")(api.health)

    @app.get("/health_generate")  # SGLang's name of /health?generate=1
    async def health_generate() -> JSONResponse:
        return await api.health(generate=True)

    add_sglang_routes(app, frontend, args, info or {})
    app.get("/stats")(api.stats)
    app.get("/metrics", response_class=PlainTextResponse)(api.metrics)  # documents text/plain
    app.get("/v1/models")(api.models)
    app.post("/tokenize")(api.tokenize)
    app.post("/detokenize")(api.detokenize)

    # a plain (not streamed) response stops when its client leaves
    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.complete(req))

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.chat_complete(req))

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.generate(req))

    app.add_middleware(
        Gate,
        api_key=args.api_key,
        max_body=args.max_request_bytes,
        frontend=frontend,
        paths=frozenset(getattr(r, "path", "") for r in app.routes),
    )
    return app
