"""/health with SGLang's `generate` (`HealthProbe`: one token through every process, within
--health-check-timeout; /health_generate too) and /stats with every API process's counts,
ahead of the core's."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from minisgl.core import SamplingParams
from minisgl.ext.serving.metrics import all_views
from minisgl.ext.serving.options import serving_options
from minisgl.message import TokenizeMsg
from minisgl.server.api_server import ApiServer
from minisgl.server.protocol import error_response


class HealthProbe:
    """/health?generate=1's check (SGLang's health_generate): one greedy token from token id 0
    through the tokenizer, each --dp replica's scheduler and the detokenizer (not counted
    against --max-queued-requests); None, or why it failed. Probes at once share one."""

    def __init__(self, api: ApiServer) -> None:
        self.api = api
        self.timeout = serving_options(api.args).health_check_timeout
        self.running: asyncio.Future[str | None] | None = None

    async def __call__(self) -> str | None:
        if self.running is None or self.running.done():
            self.running = asyncio.ensure_future(self.generate_one_token())
        return await asyncio.shield(self.running)

    async def generate_one_token(self) -> str | None:
        frontend, dp = self.api.frontend, serving_options(self.api.args).dp
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def error_of(msg: TokenizeMsg) -> str | None:
            async with aclosing(frontend.batches([msg])) as batches:
                async for batch in batches:
                    for _, r in batch:
                        if r.error is not None:
                            return r.error
            return None

        async def one(replica: int | None) -> str | None:
            msg = TokenizeMsg(frontend.new_uid(), None, [0], None, params, dp_rank=replica)
            where = "" if replica is None else f" (replica {replica})"
            try:  # past the timeout the request is aborted as its stream closes
                error = await asyncio.wait_for(error_of(msg), self.timeout)
            except asyncio.TimeoutError:
                error = f"request timed out after {self.timeout:g} s"
            return None if error is None else f"health check generation failed{where}: {error}"

        errors = await asyncio.gather(*(one(r) for r in ([None] if dp == 1 else range(dp))))
        return next((e for e in errors if e is not None), None)


def add_status_routes(app: FastAPI, api: ApiServer, info: dict[str, Any]) -> None:
    """/health and /stats (a `routes` point), served instead of the core's, which document
    them (the same parameters); /health_generate."""
    probe = HealthProbe(api)

    async def health(generate: bool = False) -> JSONResponse:
        """200 while the pipeline is up; with `generate`, once the probe passed too."""
        if generate and not api.frontend.dead and (error := await probe()) is not None:
            return error_response(503, error, code="server_unavailable")
        return await api.health()

    async def stats() -> dict[str, Any]:
        """The core's, the counts summed over the API processes (and each's, with several)."""
        views = await all_views(api)
        keys = ("in_flight", "queued", "rss_bytes")
        out = await api.stats() | {k: sum(getattr(v, k) for v in views) for k in keys}
        if len(views) > 1:
            each = ("rank", "pid", "in_flight", "queued")
            out["api_servers"] = [{k: getattr(v, k) for k in each} for v in views]
        return out

    async def health_generate() -> JSONResponse:  # SGLang's name of /health?generate=1
        return await health(generate=True)

    app.get("/health", include_in_schema=False)(health)
    app.get("/health_generate")(health_generate)
    app.get("/stats", include_in_schema=False)(stats)
