"""SGLang's native endpoints that sglang-router (and SGLang's own tools) call on a worker:
/model_info, /server_info (and their /get_* names), /get_load, /flush_cache (the `routes`
point; /health_generate is `status.py`'s); /generate's `meta_info` (`MetaInfoFields`, the
`request_fields` point); and the fields of SGLang's /generate body that minisgl does not
implement, accepted only at SGLang's defaults (else a 400 naming the field: never accepted and
ignored; the `unknown_fields` point: without it the core's /generate refuses every one)."""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse  # fastapi's is it (fastapi: only in the API process)

from minisgl.ext.serving.options import serving_options
from minisgl.server.args import ServerArgs
from minisgl.server.protocol import APIError, ExtensionFields, error_response

if TYPE_CHECKING:  # types only: the extension loads while the api server module may be loading
    from fastapi import FastAPI

    from minisgl.server.api_server import ApiServer

# SGLang's GenerateReqInput fields that change nothing at these values ("rid" names a request:
# any value; it is not used to address it here). sglang-router 0.3 sends return_text_in_logprobs,
# log_metrics, return_hidden_states, background, no_logs, return_bytes and return_entropy at
# these values with every /generate it forwards.
ANY = object()
SGLANG_GENERATE_DEFAULTS: dict[str, Any] = {
    "rid": ANY,
    "return_logprob": False,
    "logprob_start_len": -1,
    "top_logprobs_num": 0,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "return_hidden_states": False,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "modalities": None,
    "lora_path": None,
    "lora_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "log_metrics": True,
    "background": False,
    "no_logs": False,
    "return_bytes": False,
    "return_entropy": False,
}


def check_generate_extras(extra: dict[str, Any]) -> None:
    """/generate's undeclared fields: SGLang's at their defaults pass, any other is a 400."""
    for name, value in extra.items():
        if name not in SGLANG_GENERATE_DEFAULTS:
            raise APIError(400, f"{name}: unknown field of /generate", name, "unknown_field")
        default = SGLANG_GENERATE_DEFAULTS[name]
        if default is not ANY and value is not None and value != default:
            message = f"{name}: only {default!r} (SGLang's default) is supported, got {value!r}"
            raise APIError(400, message, name, "unsupported_parameter")


class MetaInfo:
    """SGLang's `meta_info` of a /generate request (a `ChoiceShaper`), as its replies come:
    counts, the prompt tokens the prefix cache supplied, how it finished, and (once finished)
    its latency."""

    def __init__(self) -> None:
        self.start, self.cached, self.last_token = time.perf_counter(), 0, -1  # -1: no token yet
        self.reply: Any = None

    def add(self, index: int, r: Any) -> None:
        self.reply = r
        if r.cached_tokens is not None:
            self.cached = r.cached_tokens
        if r.token_ids:
            self.last_token = r.token_ids[-1]

    def finish(self, r: Any) -> dict[str, Any] | None:
        """SGLang's finish_reason: its type, and what ended it (a stop string, else the stop
        token: EOS or one of stop_token_ids)."""
        if not r.finished:
            return None
        if r.finish_reason == "length":
            return {"type": "length", "length": r.completion_tokens}
        if r.finish_reason != "stop":
            return {"type": "abort"}
        matched = r.matched if r.matched is not None else self.last_token
        return {"type": "stop"} | ({} if matched == -1 else {"matched": matched})

    def fields(self, index: int) -> dict[str, Any]:
        r = self.reply
        out: dict[str, Any] = {
            "id": str(r.uid),
            "finish_reason": self.finish(r),
            "prompt_tokens": r.prompt_tokens,
            "completion_tokens": r.completion_tokens,
            "cached_tokens": self.cached,
        }
        if r.finished:
            out["e2e_latency"] = time.perf_counter() - self.start  # seconds, as SGLang's
        return {"meta_info": out}


class MetaInfoFields(ExtensionFields):
    """No fields: every /generate response gets SGLang's meta_info."""

    async def shaper(self, chat: bool, msgs: list[Any], api: Any) -> MetaInfo:
        return MetaInfo()


def _public_options(args: ServerArgs) -> dict[str, Any]:
    """Every option's value, flat (SGLang's server_info shape), the API key left out."""
    options: dict[str, Any] = {}
    for part in (args.engine, args.scheduler, args, *args.extras.values()):
        for f in dataclasses.fields(part):
            if "help" in f.metadata and f.name != "api_key":
                options[f.name] = getattr(part, f.name)
    return options


def add_sglang_routes(app: FastAPI, api: ApiServer, info: dict) -> None:
    """The routes, on `app`; `info`: what the schedulers reported once ready."""
    from minisgl.ext.serving.frontend import ServingFrontend  # the API process's (prometheus)

    frontend, args = api.frontend, api.args
    model = args.engine.model or ""
    page_size = args.engine.page_size

    def replica_stats() -> list[Any]:
        """Each --dp replica's scheduler snapshot (an app built without its launcher: one)."""
        if isinstance(frontend, ServingFrontend):
            return frontend.replica_stats
        return [frontend.stats]

    async def model_info() -> dict[str, Any]:
        return {
            "model_path": model,
            "tokenizer_path": model,
            "served_model_name": args.served_model_name or model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }

    async def server_info() -> dict[str, Any]:
        states = [dataclasses.asdict(s) for s in replica_stats()]
        return _public_options(args) | {
            "version": "minisgl",
            "tp_size": args.tp,
            "dp_size": serving_options(args).dp,
            "max_total_num_tokens": info.get("num_pages", 0) * page_size,
            "max_seq_len": info.get("max_seq_len"),
            "internal_states": states,
        }

    async def get_load() -> list[dict[str, Any]]:
        """Per replica: requests running and waiting, KV tokens in use (SGLang's shape)."""
        return [
            {
                "dp_rank": s.dp_rank,
                "num_reqs": s.running + s.waiting,
                "num_waiting_reqs": s.waiting,
                "num_tokens": (s.total_pages - s.free_pages - s.cached_pages + s.locked_pages)
                * page_size,
            }
            for s in replica_stats()
        ]

    async def flush_cache() -> JSONResponse:
        """Empty every replica's prefix cache; 400 cache_busy while requests run."""
        if frontend.dead:
            return error_response(503, frontend.dead, code="server_unavailable")
        if frontend.requests:
            busy = f"cache_busy: {len(frontend.requests)} requests in flight; flush when idle"
            return error_response(400, busy, code="cache_busy")
        if not isinstance(frontend, ServingFrontend):  # e.g. an app built without its launcher
            return error_response(503, "this front end cannot flush", code="server_unavailable")
        errors = await frontend.flush_cache()
        if any(e.startswith("no answer") for e in errors):  # a scheduler is stuck
            return error_response(503, "; ".join(errors), code="server_unavailable")
        if errors:
            return error_response(400, "; ".join(errors), code="cache_busy")
        return JSONResponse({"message": "Cache flushed."})

    for path in ("/model_info", "/get_model_info"):
        app.get(path)(model_info)
    for path in ("/server_info", "/get_server_info"):
        app.get(path)(server_info)
    app.get("/get_load")(get_load)
    app.api_route("/flush_cache", methods=["GET", "POST"])(flush_cache)
