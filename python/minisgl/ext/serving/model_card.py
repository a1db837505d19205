"""`GET /v1/models` with each card's `vocab_size` (the tokenizer's, loaded once), which
benchmarks read to draw random prompt ids below it (benchmark/online/bench_serving.py): served
ahead of the core's route, which documents it (the same response)."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.server.protocol import APIError
from minisgl.tokenizer.server import needed


async def model_cards(api: Any) -> dict[str, Any]:
    """The core's `ApiServer.models`, each card with the tokenizer's vocab_size."""
    models = await api.models()
    try:
        vocab = await with_tokenizer(api, lambda tok: len(needed(tok)), "model")
    except APIError:  # a model without a tokenizer: no vocab_size
        return models
    models["data"] = [card | {"vocab_size": vocab} for card in models["data"]]
    return models


def add_models_route(app: FastAPI, api: Any, info: dict[str, Any]) -> None:
    """`api`: the core's ApiServer (a `routes` point)."""

    async def list_models() -> dict[str, Any]:
        return await model_cards(api)

    app.get("/v1/models", include_in_schema=False)(list_models)
