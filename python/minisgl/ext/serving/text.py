"""Request bodies whose text is not valid Unicode (the serving extension's gate refuses them
with a 400 naming the field): a raw byte that is not UTF-8, or a JSON escape of a lone UTF-16
surrogate, which no internal message can carry (without this check: a 500)."""

from __future__ import annotations

import json
import re
from typing import Any

# a JSON \u escape of a UTF-16 surrogate: the way a valid UTF-8 body can carry text that is not
# valid Unicode. A pair (an emoji, as ASCII-only encoders write it) matches too: only the walk
# tells them apart. A plain pattern: one with lookarounds to find lone ones takes ~25 ms per MB.
SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
LONE_SURROGATE = "a lone UTF-16 surrogate"
NOT_UTF8 = "bytes that are not UTF-8"


def _valid_text(text: str) -> bool:
    try:
        text.encode()  # in C: a lone surrogate fails
        return True
    except UnicodeEncodeError:
        return False


def _shown(name: str, raw: bool) -> str:
    """A field name that is not valid Unicode, printable: as the client wrote it, its stray
    bytes as \\xNN (`raw`: they were decoded as surrogateescape's lone surrogates), else its
    escaped surrogates as \\uNNNN."""
    if raw:
        try:
            return name.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # an escaped surrogate among the stray bytes
            pass
    return name.encode("utf-8", "backslashreplace").decode()


def _text_path(document: str | bytes, raw: bool) -> str | None:
    """The path (e.g. `messages[0].content`) of the first string of a JSON document, in
    document order, that is not valid Unicode; None when there is none or it is not JSON."""
    try:
        todo: list[tuple[str, Any]] = [("body", json.loads(document))]
    except (ValueError, RecursionError):
        return None
    while todo:  # depth first, without recursion (the nesting is the client's)
        path, value = todo.pop()
        if isinstance(value, str) and not _valid_text(value):
            return path
        if isinstance(value, dict):
            children = [(k if path == "body" else f"{path}.{k}", v) for k, v in value.items()]
            for name, _ in children:
                if not _valid_text(name):  # a field's name
                    return _shown(name, raw)
        elif isinstance(value, list):
            children = [(f"{path}[{i}]", v) for i, v in enumerate(value)]
        else:
            continue
        todo.extend(reversed(children))
    return None


def invalid_text_path(body: bytes) -> tuple[str | None, str] | None:
    """Where a body holds text that is not valid Unicode, and what it is: (a field path, or
    None when the bytes are in no string of a JSON document, and why), or None. Decoded
    strictly: json.loads would take raw surrogate bytes ('surrogatepass') for lone surrogates
    that no message can carry, and other stray bytes fail there as a 500. A valid UTF-8 body
    is parsed here only when it holds a surrogate escape (a pair, or an escaped backslash
    before `ud800`, is a false alarm the walk clears); one that is not JSON is left to
    FastAPI, which says so."""
    if not body.isascii():  # ASCII, the common case, is valid UTF-8: no copy made
        try:
            body.decode()
        except UnicodeDecodeError:  # each stray byte a lone surrogate, found by the walk
            return _text_path(body.decode(errors="surrogateescape"), raw=True), NOT_UTF8
    if not SURROGATE_ESCAPE.search(body):
        return None
    path = _text_path(body, raw=False)
    return None if path is None else (path, LONE_SURROGATE)
