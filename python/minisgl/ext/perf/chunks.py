"""A stream's chunk of a choice no extension shapes, written as one format (the `stream_chunks`
point): building and encoding `Shape.choice`'s dict took ~4 us of the API process's ~40 per
streamed token. Byte for byte the core's `Chunks.delta` (tests/unit/test_perf_chunks.py)."""

from __future__ import annotations

from json.encoder import encode_basestring
from typing import Any

from minisgl.server.api_server import Chunks, Shape, one_line


class PlainChunks(Chunks):
    def __init__(self, head: dict[str, Any], shape: Shape) -> None:
        super().__init__(head, shape)
        self.plain = not shape.shapers and shape.shaping is None

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
