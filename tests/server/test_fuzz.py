"""Fuzz the real server through its own OpenAPI schema (hypothesis): bodies valid for the schema,
valid bodies with one field replaced by arbitrary JSON (NaN and huge numbers included), and
arbitrary JSON. No answer may be a 5xx, no stream may carry a server error, and afterwards the
server is healthy, serves a normal request and holds no KV page or prefix-cache lock."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from support.server import SHORT_SERVER, Server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
CASES_PER_ENDPOINT = 70

# Numbers at the edges of what msgpack, int64 tensors and floats hold.
EXTREMES = st.sampled_from(
    [2**63 - 1, -(2**63), 2**63, 2**64, 10**30, 1e308, -1e308, 5e-324, 0.0, -0.0]
)
ANY_JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | EXTREMES
    | st.floats()  # NaN and infinities too: Python's json writes and reads them
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


TOKEN_IDS = st.lists(st.integers(0, 479), min_size=1, max_size=12)
EDGE_INTS = st.sampled_from([0, -1, 2**31, 2**32, 2**63 - 1, -(2**63)])
SAMPLING = {
    "model": st.none(),
    "max_tokens": st.integers(1, 16),
    "max_new_tokens": st.integers(1, 16),
    "max_completion_tokens": st.integers(1, 16),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.05, 1),
    "top_k": st.integers(-1, 600) | EDGE_INTS,
    "min_p": st.floats(0, 0.5),
    "seed": st.integers(0, 100) | EDGE_INTS,
    "n": st.integers(1, 3),
    "stop_token_ids": st.lists(st.integers(0, 600) | EDGE_INTS, max_size=3),
}
# Values a client would plausibly send, so that most cases get past validation and run.
HINTS = SAMPLING | {
    "role": st.sampled_from(["system", "user", "assistant"]),
    "content": st.text(max_size=12),
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=12)}
        ),
        min_size=1,
        max_size=2,
    ),
    "prompt": st.text(max_size=40) | TOKEN_IDS,
    "input_ids": TOKEN_IDS,
    "sampling_params": st.fixed_dictionaries({}, optional=SAMPLING),
}


def from_schema(
    schema: dict[str, Any], spec: dict[str, Any], name: str | None = None
) -> st.SearchStrategy[Any]:
    """Values valid for the subset of JSON schema that FastAPI writes for pydantic models; a
    property with a hint mostly takes the hint's value."""
    if name in HINTS:
        plain = from_schema(schema, spec)
        return st.integers(0, 9).flatmap(lambda x: HINTS[name] if x < 8 else plain)
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return st.deferred(lambda: from_schema(spec["components"]["schemas"][name], spec))
    if "anyOf" in schema:
        return st.one_of([from_schema(s, spec) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object":
        props = {k: from_schema(v, spec, k) for k, v in schema.get("properties", {}).items()}
        required = set(schema.get("required", []))
        body = st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
        if schema.get("additionalProperties"):
            extra = st.dictionaries(st.text(max_size=10), ANY_JSON, max_size=2)
            body = st.builds(lambda b, e: e | b, body, extra)
        return body
    if kind == "array":
        items = from_schema(schema.get("items", {}), spec)
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=6)
    if kind == "integer":  # small values mostly, unbounded ones too
        lo, hi = schema.get("minimum"), schema.get("maximum")
        lo, hi = None if lo is None else int(lo), None if hi is None else int(hi)
        return st.integers(lo, hi) if lo is not None or hi is not None else (
            st.integers(-5, 600) | st.integers()
        )  # fmt: skip
    if kind == "number":
        return st.floats(
            schema.get("minimum"), schema.get("maximum"), allow_nan=False, allow_infinity=False
        )
    if kind == "string":
        return st.text(max_size=40)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return ANY_JSON  # no type: anything goes


def bodies(schema: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
    def replace_one(body: dict[str, Any], data: st.DataObject) -> dict[str, Any]:
        if body:
            body[data.draw(st.sampled_from(sorted(body)))] = data.draw(ANY_JSON)
        return body

    mutated = st.builds(replace_one, schema, st.data())
    # mostly valid bodies: those reach the tokenizer, the scheduler and the detokenizer
    return st.integers(0, 9).flatmap(lambda x: schema if x < 6 else mutated if x < 9 else ANY_JSON)


# Bodies that once took the server down or answered 500; always tried, on every endpoint.
FOUND = [
    {"prompt": "hi", "seed": 2**63 - 1, "n": 3, "max_tokens": 2},  # seed + choice overflowed
    {"prompt": "hi", "temperature": float("nan"), "max_tokens": 2},
    {"prompt": "hi", "top_k": 2**70, "max_tokens": 2},
    {"prompt": [[1, 2]], "stop_token_ids": [2**64], "max_tokens": 2},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
    {"text": "hi", "sampling_params": {"max_new_tokens": float("inf"), "seed": 2**63 - 1}},
    {"input_ids": [1], "sampling_params": {"max_new_tokens": 1e300}},
]


@pytest.fixture(scope="module")
def server(shared_server: Callable[..., Server]) -> Server:
    return shared_server(*SHORT_SERVER)  # test_schemathesis's too: a 64-token context


@pytest.fixture(scope="module")
def spec(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/openapi.json").json()


def assert_no_server_error(r: httpx.Response, body: Any) -> None:
    assert r.status_code < 500, f"{r.status_code} {r.text[:500]} for {body!r}"
    if r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"):
        assert '"server_error"' not in r.text, f"{r.text[:500]} for {body!r}"


def test_get_endpoints(server: Server, spec: dict[str, Any]) -> None:
    """Every GET route answers 200; one of a stored object (a path template, e.g.
    /v1/responses/{response_id}) answers an unknown id with a 404, never a 5xx."""
    gets = [p for p, ops in spec["paths"].items() if "get" in ops]
    assert {"/health", "/metrics", "/stats", "/v1/models"} <= set(gets)
    for path in gets:
        status = httpx.get(f"{server.url}{path}", timeout=10).status_code
        assert status == (404 if "{" in path else 200), path


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/generate"])
def test_fuzz_post_endpoints(server: Server, spec: dict[str, Any], path: str) -> None:
    schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    client = httpx.Client(timeout=120)

    @settings(
        max_examples=CASES_PER_ENDPOINT,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(body=bodies(from_schema(schema, spec)))
    def post(body: Any) -> None:
        content = json.dumps(body).encode()  # NaN / Infinity written as Python's json does
        r = client.post(
            f"{server.url}{path}", content=content, headers={"content-type": "application/json"}
        )
        assert_no_server_error(r, body)

    for body in FOUND:
        post = example(body=body)(post)
    with client:
        post()
        for garbage in (b"", b"{", b"\xff\xfe", b"[1, 2", b'{"prompt": "a" "b"}'):
            r = client.post(f"{server.url}{path}", content=garbage)
            assert r.status_code == 400, (garbage, r.text)

    assert httpx.get(f"{server.url}/health").status_code == 200
    r = httpx.post(
        f"{server.url}/v1/completions",
        json={"prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True},
        timeout=60,
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    s = server.wait_idle(timeout=60)
    assert s["leaked_pages"] == 0 and s["locked_pages"] == 0, s
    assert s["free_pages"] + s["cached_pages"] == s["total_pages"], s
