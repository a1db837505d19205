"""A stream's chunks (the `stream_chunks` point), byte for byte the core's `Chunks`
(tests/unit/test_perf_chunks.py): the head encoded once per response, and a choice no extension
shapes written as one format (building and encoding `Shape.choice`'s dict took ~4 us of the API
process's ~40 per streamed token)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring
from typing import Any

from minisgl.server.api_server import Chunks, Shape, one_line, sse


class PlainChunks(Chunks):
    def __init__(self, head: dict[str, Any], shape: Shape) -> None:
        super().__init__(head, shape)
        self.prefix = sse({**head, "choices": []})[:-4]  # without ']}' and the blank line
        self.plain = not shape.shapers and shape.shaping is None

    def __call__(self, choice: dict[str, Any], usage: dict[str, int] | None = None) -> str:
        body = one_line(json.dumps(choice, ensure_ascii=False))
        if usage is None:
            return f"{self.prefix}{body}]}}\n\n"
        return f'{self.prefix}{body}], "usage": {json.dumps(usage)}}}\n\n'

    def delta(self, index: int, text: str, reason: str | None, matched: str | None) -> str:
        if not self.plain or matched is not None:  # vLLM's stop_reason: the dict's
            return super().delta(index, text, reason, matched)
        finish = "null" if reason is None else encode_basestring(reason)
        encoded = one_line(encode_basestring(text))
        if not self.shape.chat:
            body = f'"text": {encoded}'
        else:
            body = f'"delta": {{"content": {encoded}}}' if text else '"delta": {}'
        choice = f'{{"index": {index}, {body}, "logprobs": null, "finish_reason": {finish}}}'
        return f"{self.prefix}{choice}]}}\n\n"
