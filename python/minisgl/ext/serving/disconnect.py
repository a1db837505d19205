"""A plain (not streamed) response stops when its client leaves: /v1/completions,
/v1/chat/completions and /generate served ahead of the core's routes, which document them (a
`routes` point). A streamed response notices the disconnect itself; without this extension a
plain one runs to its end."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from minisgl.server.api_server import ApiServer
from minisgl.server.protocol import ChatRequest, CompletionRequest, GenerateRequest

DISCONNECT_POLL_S = 0.2  # how often a non-streamed request checks that its client is still there
CLIENT_GONE = 499  # nginx's "client closed request": logged and counted, never seen by anyone


async def unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Await `work` unless the client leaves first; then cancel it, which aborts its requests."""
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


def add_disconnect_routes(app: FastAPI, api: ApiServer, info: dict[str, Any]) -> None:
    """The core's three generation routes, each cancelled when its client leaves."""

    @app.post("/v1/completions", include_in_schema=False)
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.complete(req))

    @app.post("/v1/chat/completions", include_in_schema=False)
    async def chat_completions(req: ChatRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.chat_complete(req))

    @app.post("/generate", include_in_schema=False)
    async def generate(req: GenerateRequest, request: Request) -> Any:
        return await unless_disconnected(request, api.generate(req))
