"""ext/perf's `PlainChunks` (the `stream_chunks` point): the streamed chunk of a choice no
extension shapes, formatted directly, is byte for byte the core's `Chunks.delta` (the dict
`Shape.choice` gives, through `json.dumps`); the server uses it whenever ext/ is there."""

from __future__ import annotations

import json

from httpx._decoders import LineDecoder
from hypothesis import given
from hypothesis import strategies as st

from minisgl.ext.lazy import Lazy
from minisgl.ext.perf.chunks import PlainChunks
from minisgl.extension import extensions
from minisgl.server.api_server import Chunks, Shape

HEAD = {"id": "cmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m"}


@given(
    chat=st.booleans(),
    index=st.integers(0, 300),
    text=st.text(),
    reason=st.sampled_from([None, "stop", "length", "abort", 'a "quoted" \\ reason']),
)
def test_plain_chunks_equal_the_encoded_choice(chat: bool, index: int, text: str, reason) -> None:
    """Any text (quotes, backslashes, control characters, non-ASCII, lone surrogates)."""
    shape = Shape(chat=chat, n=1)
    plain, chunks = PlainChunks(HEAD, shape), Chunks(HEAD, shape)
    choice = shape.choice(index, text, reason, delta=True)
    assert (
        plain.delta(index, text, reason, None)
        == chunks(choice)
        == chunks.delta(index, text, reason, None)
    )
    assert json.loads(plain.delta(index, text, reason, None)[len("data: ") :])["choices"] == [
        choice
    ]
    usage = {"prompt_tokens": 3, "completion_tokens": index, "total_tokens": 3 + index}
    assert plain(choice, usage) == chunks(choice, usage)  # continuous_usage_stats' chunk
    # split into lines as httpx's iter_lines does (str.splitlines: U+2028, U+0085... too)
    lines = LineDecoder().decode(plain.delta(index, text + "\u2028\x85\u2029", reason, None))
    assert len(lines) == 2 and lines[1] == "", lines  # the event's line, then the blank one


def test_a_stop_reason_or_a_shaped_choice_takes_the_dict() -> None:
    shape = Shape(chat=False, n=1)
    matched = PlainChunks(HEAD, shape).delta(0, "x", "stop", "END")
    assert json.loads(matched[len("data: ") :])["choices"][0]["stop_reason"] == "END"
    assert matched == Chunks(HEAD, shape).delta(0, "x", "stop", "END")

    class Echo:
        def add(self, index: int, reply: object) -> None: ...

        def fields(self, index: int) -> dict[str, object]:
            return {"extra": index}

    shaped = Shape(chat=True, n=1, shapers=[Echo()])
    assert not PlainChunks(HEAD, shaped).plain
    chunk = PlainChunks(HEAD, shaped).delta(2, "y", None, None)
    assert json.loads(chunk[len("data: ") :])["choices"][0]["extra"] == 2


def test_the_server_writes_plain_chunks_with_ext() -> None:
    point = extensions().stream_chunks
    assert isinstance(point, Lazy) and point.resolve() is PlainChunks
