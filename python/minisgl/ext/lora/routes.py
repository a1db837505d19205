"""vLLM's runtime LoRA routes (the `routes` point, behind the API key like every route):
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and POST /v1/unload_lora_adapter
{"lora_name"} (vLLM's `lora_int_id` accepted: names identify adapters here). Success is a 200
with a short text, as vLLM's; errors are OpenAI-shaped: 400 naming the field for a name taken
or an adapter that cannot be served (unreadable, rank over --max-lora-rank, modules not
supported: nothing changes), 404 for unloading an adapter not loaded. Unloading an adapter that
running requests use refuses new ones for it and waits for those (up to `UNLOAD_WAIT_S`),
then answers 400 `lora_in_use` saying how many still run (the adapter served again: with --dp,
the replicas that had dropped it load it again). With --dp a load is done on every replica or
on none (those that loaded it unload it when another could not).
Available with --enable-lora (vLLM gates them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING);
refused with --api-server-count > 1, whose other API processes would not know the change."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import PlainTextResponse
from pydantic import ConfigDict

from minisgl.ext.lora.http import serve, served_adapters
from minisgl.ext.lora.options import lora_options
from minisgl.ext.lora.runtime import LoraChange, LoraUpdateReply, LoraUpdateRequest
from minisgl.ext.serving.frontend import ServingFrontend
from minisgl.server.protocol import APIError, Body

ASK_TIMEOUT_S = 60.0  # for every replica's answer (a load reads the adapter from disk)
UNLOAD_WAIT_S = 30.0  # how long an unload waits for the requests that use the adapter
UNLOAD_POLL_S = 0.2
logger = logging.getLogger(__name__)


class LoadLoraBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_path: str
    load_inplace: bool = False  # vLLM's: replace a loaded adapter of that name (refused)


class UnloadLoraBody(Body):
    model_config = ConfigDict(strict=True, extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's handle: names identify adapters here


def add_lora_routes(app: FastAPI, api: Any, info: dict[str, Any]) -> None:
    """`api`: the core's ApiServer, whose `adapters` (/v1/models, `model`): --lora-modules'
    and those loaded here."""
    api.adapters.update(served_adapters(api.args))
    enabled = lora_options(api.args.scheduler).enable_lora
    base = api.args.served_model_name or api.args.engine.model

    async def load(body: LoadLoraBody) -> PlainTextResponse:
        name, path = body.lora_name, body.lora_path
        frontend = _frontend(api, enabled)
        if body.load_inplace:
            raise APIError(400, "load_inplace is not supported: unload first", "load_inplace")
        if not name or name in api.adapters or name in api.served:
            why = "is empty" if not name else "is already loaded (or the base model's name)"
            raise APIError(400, f"lora_name {name!r} {why}", "lora_name")
        if not path:
            raise APIError(400, "lora_path is empty", "lora_path")
        await _load(frontend, name, path)
        serve(name, {"root": path, "parent": base}, api)
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(body: UnloadLoraBody) -> PlainTextResponse:
        name, frontend = body.lora_name, _frontend(api, enabled)
        fields = api.adapters.get(name)
        serve(name, None, api)  # new requests for it: 404 while its running ones end
        try:
            await _unload(frontend, name, fields["root"] if fields is not None else None)
        except Unserved:
            raise  # some replica lost it: no longer served (unload again to finish)
        except BaseException:
            if fields is not None:  # still served, on every replica
                serve(name, fields, api)
            raise
        return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")

    app.post("/v1/load_lora_adapter")(load)
    app.post("/v1/unload_lora_adapter")(unload)


def _frontend(api: Any, enabled: bool) -> ServingFrontend:
    """The API process's front end, when it may change the adapters (else the APIError)."""
    if not enabled:
        raise APIError(400, "loading and unloading LoRA adapters needs --enable-lora", "lora_name")
    frontend = api.frontend
    if frontend.dead:
        raise APIError(503, frontend.dead, code="server_unavailable")
    if not isinstance(frontend, ServingFrontend) or not frontend.scheduler_addrs:
        raise APIError(503, "this front end cannot change adapters", code="server_unavailable")
    if frontend.api_count > 1:
        message = "runtime LoRA loading is not supported with --api-server-count > 1"
        raise APIError(400, message, "api_server_count")
    return frontend


async def _ask(frontend: ServingFrontend, change: LoraChange) -> list[LoraUpdateReply]:
    """Every replica's answer to `change` (503 when one does not answer)."""

    def request(api_rank: int) -> LoraUpdateRequest:
        return LoraUpdateRequest(change, api_rank)

    replies = await frontend.ask_schedulers(request, LoraUpdateReply, ASK_TIMEOUT_S)
    if len(replies) < len(frontend.scheduler_addrs):
        message = f"no answer from the schedulers in {ASK_TIMEOUT_S:g} s"
        raise APIError(503, message, code="server_unavailable")
    return replies


async def _load(frontend: ServingFrontend, name: str, path: str) -> None:
    """Load `name` on every replica, or on none (the APIError, 400 naming the field): with
    --dp, the replicas that loaded it unload it again when another could not."""
    replies = await _ask(frontend, LoraChange(name, path))
    errors = [r for r in replies if r.error is not None]
    if not errors:
        return
    if len(errors) < len(replies):  # roll back (the name is not served yet: none uses it)
        loaded = {r.dp_rank for r in replies if r.error is None}
        undone = await _ask(frontend, LoraChange(name))
        if kept := [r for r in undone if r.dp_rank in loaded and r.error is not None]:
            logger.error("LoRA adapter %r: rollback failed: %s", name, "; ".join(map(_said, kept)))
    field = "lora_name" if "already loaded" in str(errors[0].error) else "lora_path"
    raise APIError(400, "; ".join(_said(r) for r in errors), field)


class Unserved(APIError):
    """An unload that failed after some replicas dropped the adapter, which they could not
    load again: the adapter is no longer served."""


async def _unload(frontend: ServingFrontend, name: str, path: str | None) -> None:
    """Unload `name` from every replica, waiting while requests use it (the APIError: 404 not
    loaded, 400 `lora_in_use` after `UNLOAD_WAIT_S`). On an error, with --dp, the replicas
    that already dropped it load it again from `path`, so that it is served by all as before
    (`Unserved` when that fails)."""
    removed: set[int] = set()  # the replicas that unloaded it
    deadline = time.monotonic() + UNLOAD_WAIT_S
    while True:
        replies = await _ask(frontend, LoraChange(name))
        removed |= {r.dp_rank for r in replies if r.error is None}
        failed = [r for r in replies if r.error is not None and r.dp_rank not in removed]
        # 404: a replica without it (all of them: not loaded; some: a past `Unserved`'s)
        left = [r for r in failed if r.status != 404]
        if not left and (removed or not failed):
            return
        if not left or any(r.status != 409 for r in left) or time.monotonic() > deadline:
            error = _unload_error(left or failed)
            if removed:
                await _restore(frontend, name, path, removed, error)
            raise error
        await asyncio.sleep(UNLOAD_POLL_S)  # its requests run on: ask again


def _unload_error(left: list[LoraUpdateReply]) -> APIError:
    """The failed unload's error, from the replicas that kept the adapter."""
    status = next((r.status for r in left if r.status != 409), 409)
    message = "; ".join(_said(r) for r in left)
    if status == 404:
        return APIError(404, message, "lora_name", "model_not_found")
    if status == 409:  # a 400 (the statuses every POST route documents)
        message += f", still after waiting {UNLOAD_WAIT_S:g} s"
    return APIError(400, message, "lora_name", "lora_in_use" if status == 409 else None)


async def _restore(
    frontend: ServingFrontend, name: str, path: str | None, removed: set[int], error: APIError
) -> None:
    """The replicas in `removed` load `name` again from `path` (the others still have it and
    answer that it is loaded); `Unserved` with `error`'s reply when one cannot."""
    replies: list[LoraUpdateReply] = []
    with contextlib.suppress(APIError):  # a 503: no answer, so not loaded again
        replies = await _ask(frontend, LoraChange(name, path)) if path is not None else []
    done = {r.dp_rank for r in replies if r.error is None}
    if lost := sorted(removed - done):
        why = {r.dp_rank: f": {r.error}" for r in replies if r.error is not None}
        failed = ", ".join(f"{rank}{why.get(rank, '')}" for rank in lost)
        message = (
            f"{error.message}; replica {failed} dropped it and could not load it again: it is"
            " no longer served (unload it again to finish)"
        )
        raise Unserved(error.status, message, error.param, error.code) from error


def _said(reply: LoraUpdateReply) -> str:
    return str(reply.error) if reply.dp_rank == 0 else f"replica {reply.dp_rank}: {reply.error}"
