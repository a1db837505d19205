"""The multi-process server, started for real (`python -m minisgl`) on a tiny model and driven
with the official `openai` client and raw HTTP.

Servers: the main one (two tokenizer workers; stopped with SIGTERM while a client streams), a
strict one (64-token context, and an API key where the serving extension is; stopped with a
terminal's Ctrl-C, i.e. SIGINT to its process group) and one stopped while it starts. None may leave a
process behind. Greedy results are compared with the offline `LLM` on the same checkpoint."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import random
import signal
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from transformers import AutoTokenizer

from minisgl import env
from support.server import Server, descendants, make_tiny_model, run_server, wait_for

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
NAME = "tiny-qwen3"  # the model directory's name, which the server also answers to
API_KEY = "sk-test-key"
CONTEXT = 32768  # the main server's: a request of CONTEXT - 100 tokens runs 10 s or more
STRICT_CONTEXT = 64
IGNORE_EOS = {"ignore_eos": True}
CHAT = [{"role": "user", "content": "hello world, the quick brown fox"}]
# as tests/conftest.py decides which tests are `ext`: the servers started have minisgl/ext
WITH_EXTENSIONS = (
    importlib.util.find_spec("minisgl.ext") is not None and not env.disable_extensions()
)
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "generate": "/generate"}


# ---- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / NAME), CONTEXT)


@pytest.fixture(scope="module")
def tokenizer(model_dir: str) -> Any:
    return AutoTokenizer.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def server(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("logs") / "main.log")
    args = ("--page-size", "4", "--num-tokenizer", "2", "--shutdown-timeout", "1")
    with run_server(model_dir, *args, log_path=log, stop_signal=signal.SIGTERM) as s:
        yield s


@pytest.fixture(scope="module")
def strict(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = str(tmp_path_factory.mktemp("logs") / "strict.log")
    args = ("--page-size", "4", "--max-model-len", str(STRICT_CONTEXT))
    if WITH_EXTENSIONS:  # --api-key is the serving extension's
        args += ("--api-key", API_KEY)
    # stopped like a Ctrl-C in its terminal: SIGINT to the whole process group
    with run_server(model_dir, *args, log_path=log, stop_signal=signal.SIGINT, group=True) as s:
        yield s


@pytest.fixture(scope="module")
def offline(model_dir: str) -> Any:
    from minisgl import LLM

    return LLM(model_dir, page_size=4)


@pytest.fixture(scope="module")
def client(server: Server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)


def chat_prompt_len(tokenizer: Any, messages: list[dict[str, str]]) -> int:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tokenizer.encode(text, add_special_tokens=False))


def assert_pages_released(stats: dict[str, int]) -> None:
    assert stats["free_pages"] + stats["cached_pages"] == stats["total_pages"], stats
    assert stats["locked_pages"] == 0, stats


def assert_serves(server: Server, headers: dict[str, str] | None = None) -> None:
    """Health is fine and a small request still completes."""
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


# ---- the OpenAI API -----------------------------------------------------------------------
def test_models_lists_the_model(client: OpenAI, model_dir: str) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model_dir]
    assert models[0].model_extra["max_model_len"] == CONTEXT


def test_chat_stream_equals_non_stream(client: OpenAI, tokenizer: Any, model_dir: str) -> None:
    kwargs: dict[str, Any] = dict(
        model=model_dir, messages=CHAT, max_tokens=12, temperature=0, extra_body=IGNORE_EOS
    )
    full = client.chat.completions.create(**kwargs)
    choice = full.choices[0]
    assert full.object == "chat.completion"
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    prompt_len = chat_prompt_len(tokenizer, CHAT)
    assert full.usage.prompt_tokens == prompt_len
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == prompt_len + 12

    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == "length" and set(reasons[:-1]) == {None}
    # the usage chunk comes last, with no choices
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    streamed, plain = chunks[-1].usage.model_dump(), full.usage.model_dump()
    # the same prompt again: the prefix cache supplies part of it this time
    cached = [u.pop("prompt_tokens_details")["cached_tokens"] for u in (plain, streamed)]
    assert cached[0] <= cached[1] and streamed == plain
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_equals_non_stream(client: OpenAI, tokenizer: Any) -> None:
    prompt = "the lazy dog jumps over"
    kwargs: dict[str, Any] = dict(
        model="x", prompt=prompt, max_tokens=10, temperature=0, extra_body=IGNORE_EOS
    )
    # the served model is also known by its directory's name, and "x" is not it
    with pytest.raises(openai.NotFoundError):
        client.completions.create(**kwargs)
    kwargs["model"] = NAME
    full = client.completions.create(**kwargs)
    assert full.object == "text_completion"
    assert full.choices[0].finish_reason == "length" and full.choices[0].text
    assert full.usage.prompt_tokens == len(tokenizer.encode(prompt))
    assert full.usage.completion_tokens == 10

    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def test_n_choices(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, messages=CHAT, max_tokens=6, temperature=0, n=2)
    full = client.chat.completions.create(**kwargs, extra_body=IGNORE_EOS)
    assert [c.index for c in full.choices] == [0, 1]
    texts = [c.message.content for c in full.choices]
    assert texts[0] == texts[1]  # greedy: both choices are the same
    assert full.usage.completion_tokens == 12

    stream = client.chat.completions.create(**kwargs, stream=True, extra_body=IGNORE_EOS)
    streamed = ["", ""]
    finished = [None, None]
    for chunk in stream:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            finished[c.index] = finished[c.index] or c.finish_reason
    assert streamed == texts and finished == ["length", "length"]

    # sampled choices get different seeds
    sampled = client.completions.create(
        model=NAME,
        prompt="cat",
        max_tokens=16,
        temperature=1.0,
        n=2,
        seed=7,
        extra_body=IGNORE_EOS,
    )
    assert sampled.choices[0].text != sampled.choices[1].text


def test_seed_reproduces_sampling(client: OpenAI) -> None:
    def sample(seed: int) -> str:
        out = client.completions.create(
            model=NAME,
            prompt="quick brown",
            max_tokens=16,
            temperature=1.0,
            seed=seed,
            extra_body=IGNORE_EOS,
        )
        return out.choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(4321) != first


def pick_stop(text: str) -> str:
    """A 3-character piece of `text`, not at its start, with no undecodable byte in it."""
    for i in range(2, len(text) - 3):
        piece = text[i : i + 3]
        if "\ufffd" not in piece and text.find(piece) > 0:
            return piece
    raise AssertionError(f"no stop string to pick in {text!r}")


def test_stop_strings(client: OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model=NAME, prompt=[40, 41, 42, 43], max_tokens=24, temperature=0)
    free = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0]
    assert free.finish_reason == "length"
    stop = pick_stop(free.text)
    expected = free.text[: free.text.find(stop)]

    out = client.completions.create(**kwargs, stop=stop, extra_body=IGNORE_EOS)
    assert out.choices[0].text == expected and stop not in out.choices[0].text
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24

    chunks = list(
        client.completions.create(
            **kwargs, stop=["never-seen", stop], stream=True, extra_body=IGNORE_EOS
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    # a stop string that never occurs changes nothing
    out = client.completions.create(**kwargs, stop=["never-seen"], extra_body=IGNORE_EOS)
    assert out.choices[0].text == free.text and out.choices[0].finish_reason == "length"

    # one right at the start leaves nothing
    for prompt in ([100, 101, 102, 103], [7, 8, 9], [300, 301]):
        kwargs["prompt"] = prompt
        text = client.completions.create(**kwargs, extra_body=IGNORE_EOS).choices[0].text
        if "\ufffd" not in text[:3]:
            break
    out = client.completions.create(**kwargs, stop=text[:3], extra_body=IGNORE_EOS)
    assert (out.choices[0].text, out.choices[0].finish_reason) == ("", "stop")


def test_token_id_prompt_and_native_generate(server: Server, client: OpenAI, offline: Any) -> None:
    from minisgl import SamplingParams

    ids = [10, 200, 300, 479, 500]  # 500: a model token the tokenizer does not know
    ref = offline.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    out = client.completions.create(
        model=NAME, prompt=ids, max_tokens=8, temperature=0, extra_body=IGNORE_EOS
    )
    assert out.choices[0].text == ref[0]["text"]
    assert out.usage.prompt_tokens == len(ids)
    assert out.usage.completion_tokens == 8

    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    native = httpx.post(f"{server.url}/generate", json=body, timeout=60).json()
    assert native["output_ids"] == ref[0]["token_ids"]  # the completion's tokens
    assert native["text"] == out.choices[0].text
    assert native["finish_reason"] == "length"
    assert (native["prompt_tokens"], native["completion_tokens"]) == (len(ids), 8)

    # streamed: the same ids, in pieces
    streamed: list[int] = []
    with httpx.stream("POST", f"{server.url}/generate", json=body | {"stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["token_ids"]
    assert streamed == native["output_ids"]


def test_concurrent_streams_match_offline(server: Server, offline: Any) -> None:
    from minisgl import SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(3, 480) for _ in range(rng.randint(3, 40))] for _ in range(32)]
    lengths = [rng.randint(4, 24) for _ in prompts]

    async def one(aclient: AsyncOpenAI, prompt: list[int], max_tokens: int) -> tuple[str, int]:
        stream = await aclient.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=IGNORE_EOS,
        )
        text, completion = "", -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                completion = chunk.usage.completion_tokens
        return text, completion

    async def run_all() -> list[tuple[str, int]]:
        aclient = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=120)
        async with aclient:
            return await asyncio.gather(*(one(aclient, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(run_all())

    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths]
    refs = offline.generate(prompts, params, use_tqdm=False)
    for i, ((text, completion), ref) in enumerate(zip(results, refs)):
        assert completion == lengths[i] == len(ref["token_ids"])
        assert text == ref["text"], f"request {i}"
    assert_pages_released(server.wait_idle())


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_aborts_the_request(server: Server, endpoint: str) -> None:
    before = server.wait_idle()
    body: dict[str, Any] = {
        "max_tokens": CONTEXT - 100,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if endpoint == "chat":  # two choices, both to abort
        body |= {"messages": [{"role": "user", "content": "a long story"}], "n": 2}
    else:
        body["prompt"] = [7, 77, 177, 277, 377, 477]  # no other test's: not in the cache
    with httpx.stream("POST", f"{server.url}{PATHS[endpoint]}", json=body, timeout=60) as r:
        assert r.status_code == 200
        chunks = 0
        for line in r.iter_lines():
            chunks += line.startswith("data: ")
            if chunks == 5:
                break  # leaving the block closes the connection mid-stream

    # Its KV goes to the prefix cache when it stops (so the cache grows; until then /stats may
    # still show the idle snapshot from before it started): far short of the whole request.
    def settled() -> dict[str, int] | None:
        s = server.stats()
        return s if s["running"] == 0 and s["cached_pages"] > before["cached_pages"] else None

    after = wait_for(settled, 30, "the aborted request's pages to reach the prefix cache")
    assert_pages_released(after)
    grown = after["cached_pages"] - before["cached_pages"]
    assert grown * 4 < body["max_tokens"] // 2, (before, after)
    assert_serves(server)


BAD_REQUESTS = [
    ("chat", b"{not json", 400, None),
    ("chat", {}, 400, "messages"),
    ("chat", {"messages": "hello"}, 400, "messages"),
    ("chat", {"messages": []}, 400, "messages"),
    ("chat", {"messages": [{"content": "no role"}]}, 400, "role"),
    ("chat", {"messages": CHAT, "max_tokens": "abc"}, 400, "max_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": CHAT, "max_tokens": -5, "stream": True}, 400, "max_tokens"),
    ("chat", {"messages": CHAT, "temperature": -0.5}, 400, "temperature"),
    ("chat", {"messages": CHAT, "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": CHAT, "top_p": 1.5, "stream": True}, 400, "top_p"),
    ("chat", {"messages": CHAT, "n": 0}, 400, "n"),
    ("chat", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "role"),
    ("chat", {"messages": CHAT, "model": "no-such-model"}, 404, "model"),
    ("completions", {"prompt": "hi", "model": "no-such-model"}, 404, "model"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("completions", {"prompt": {"not": "a prompt"}}, 400, "prompt"),
    ("completions", {"prompt": []}, 400, "prompt"),
    ("completions", {"prompt": [1, -2, 3]}, 400, "prompt"),
    ("completions", {"prompt": [1, 2**40]}, 400, "prompt"),
    ("completions", {"prompt": [1, 99999]}, 400, "prompt"),
    ("completions", {"prompt": ["one"] * 1025}, 400, "prompt"),  # over MAX_CHOICES
    ("completions", {"prompt": "hi", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("generate", {"input_ids": [1, 2], "text": "both"}, 400, "input_ids"),
    ("generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "x"}}, 400, None),
    ("generate", {"input_ids": [1, 2], "sampling_params": {"temperature": "hot"}}, 400, None),
    ("generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}}, 400, None),
]


@pytest.mark.parametrize(
    "endpoint,body,status,mentions", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))]
)
def test_bad_requests_get_openai_errors(
    server: Server, endpoint: str, body: Any, status: int, mentions: str | None
) -> None:
    url = f"{server.url}{PATHS[endpoint]}"
    if isinstance(body, bytes):
        r = httpx.post(url, content=body, headers={"content-type": "application/json"})
    else:
        r = httpx.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert {"param", "code"} <= set(error)
    if mentions is not None:
        assert mentions in error["message"], error
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_bad_requests_through_the_client(server: Server, client: OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.chat.completions.create(model=NAME, messages=CHAT, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=NAME, prompt="hi", temperature=-1, stream=True)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert_serves(server)
    assert_pages_released(server.wait_idle())


def stream_in_background(server: Server) -> threading.Event:
    """Start a long streamed request in a thread; the event is set once its stream has ended
    (finished, or cut by the server going away)."""
    ended = threading.Event()

    def read() -> None:
        body = {"prompt": [5, 6], "max_tokens": CONTEXT - 100, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
                for _ in r.iter_lines():
                    pass
        except httpx.HTTPError:
            pass
        ended.set()

    threading.Thread(target=read, daemon=True).start()
    wait_for(lambda: server.stats()["running"] == 1, 30, "the streamed request to run")
    return ended


def test_sigterm_with_a_stream_in_flight(server: Server) -> None:
    """The main server's last test: SIGTERM stops it (exit 0, no process left) even while a
    client is mid-stream, and that client is not left hanging."""
    ended = stream_in_background(server)
    assert server.stop(signal.SIGTERM) == 0
    assert ended.wait(15), "the streaming client still hangs"


# ---- API key and a short context ----------------------------------------------------------
@pytest.mark.ext  # --api-key: the serving extension
def test_api_key(strict: Server) -> None:
    assert httpx.get(f"{strict.url}/health").status_code == 200  # health stays open
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": API_KEY}):
        r = httpx.get(f"{strict.url}/v1/models", headers=headers)
        assert r.status_code == 401, r.text
        assert r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(f"{strict.url}/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{strict.url}/v1", api_key="wrong", max_retries=0).models.list()
    good = OpenAI(base_url=f"{strict.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    assert good.models.list().data[0].model_extra["max_model_len"] == STRICT_CONTEXT
    out = good.completions.create(model=NAME, prompt="hi", max_tokens=2)
    assert len(out.choices) == 1


def test_prompt_longer_than_the_context(strict: Server) -> None:
    client = OpenAI(base_url=f"{strict.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="longer than the context"):
        client.completions.create(model=NAME, prompt=list(range(3, 103)))
    with pytest.raises(openai.BadRequestError, match="longer than the context"):
        long = [{"role": "user", "content": "the quick brown fox " * 30}]
        client.chat.completions.create(model=NAME, messages=long, stream=True)
    # a prompt that fits but asks for more than the context holds: vLLM's 400, with the numbers
    too_many = (
        r"prompt \(10 tokens\) \+ max_tokens \(1000\) = 1010 tokens is longer than the context"
    )
    with pytest.raises(openai.BadRequestError, match=too_many):
        client.completions.create(model=NAME, prompt=list(range(3, 13)), max_tokens=1000)
    # a chat without max_tokens runs up to the context
    hi = [{"role": "user", "content": "hi"}]
    out = client.chat.completions.create(
        model=NAME, messages=hi, temperature=0, extra_body=IGNORE_EOS
    )
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == STRICT_CONTEXT
    assert_serves(strict, headers={"authorization": f"Bearer {API_KEY}"})
    assert_pages_released(strict.wait_idle())


# ---- stopped while starting (a dying child: tests/test_reliability.py) -------------------
def test_sigterm_during_start_up(model_dir: str, tmp_path: Any) -> None:
    """Stopped while its children still load: they must not be orphaned."""
    server = Server(model_dir, "--page-size", "4", log_path=str(tmp_path / "early.log"))
    try:
        wait_for(lambda: "tokenizer_0 process started" in server.log(), 60, "the children")
        server.children = descendants(server.proc.pid)
        assert server.stop(signal.SIGTERM) == 0
    finally:
        if server.proc.poll() is None:
            server.kill_all()
