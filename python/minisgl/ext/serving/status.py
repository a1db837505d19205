"""/health?generate=1's probe (`HealthProbe`, set on the ApiServer by the `routes` point): one
token through every process, within --health-check-timeout."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from typing import Any

from minisgl.core import SamplingParams
from minisgl.ext.serving.options import serving_options
from minisgl.message import TokenizeMsg
from minisgl.server.api_server import ApiServer


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
        frontend, dp = self.api.frontend, self.api.args.dp
        params = SamplingParams(max_tokens=1, temperature=0.0)

        async def one(replica: int | None) -> str | None:
            msg = TokenizeMsg(frontend.new_uid(), None, [0], None, params, dp_rank=replica)
            where = "" if replica is None else f" (replica {replica})"
            async with aclosing(frontend.stream(msg, self.timeout)) as replies:
                async for r in replies:
                    if r.error is not None:
                        return f"health check generation failed{where}: {r.error}"
            return None

        errors = await asyncio.gather(*(one(r) for r in ([None] if dp == 1 else range(dp))))
        return next((e for e in errors if e is not None), None)


def add_health_probe(app: Any, api: ApiServer, info: dict[str, Any]) -> None:
    api.health_probe = HealthProbe(api)
