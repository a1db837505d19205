"""LoRA adapters through the server (ext/lora): `model` picks an adapter through the official
OpenAI client, /generate's `lora_path` too, each answer the offline one (which
tests/engine/test_lora.py checks against PEFT); /v1/models lists the adapters with their
parent; an unknown adapter is a 404; an adapter over --max-lora-rank stops the start with a
CLI error naming the flag. /v1/load_lora_adapter and /v1/unload_lora_adapter change the served
adapters at run time (a bad load changes nothing; an unload waits for the adapter's requests),
behind the API key, and only with --enable-lora; with --tp 2 on every rank, with --dp 2 on
both replicas (tests/unit/test_lora_runtime.py: a partial failure, the unload's timeout)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from minisgl import LLM, SamplingParams
from minisgl.ext.lora import LoRARequest
from support.lora import edit_config, save_adapter
from support.server import REPO, free_port, make_tiny_model, run_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PROMPT = "hello world"
IDS = [5, 9, 14, 3, 27, 8]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(server, {name: offline completion text of PROMPT}, {name: offline ids of IDS})."""
    root = tmp_path_factory.mktemp("lora")
    model = make_tiny_model(str(root / "tiny"))
    a1, a2 = str(root / "a1"), str(root / "a2")
    save_adapter("qwen3", a1, seed=1)
    save_adapter("qwen3", a2, seed=2, r=4, target_modules=["q_proj", "v_proj", "down_proj"])
    llm = LLM(model, page_size=4, enable_lora=True, max_loras=2, max_lora_rank=8)
    texts, ids = {}, {}
    try:
        for name, path in [("base", None), ("a1", a1), ("a2", a2)]:
            request = LoRARequest(name, 1, path) if path else None
            params = SamplingParams(max_tokens=8)
            out = llm.generate([PROMPT, IDS], params, use_tqdm=False, lora_request=request)
            texts[name], ids[name] = out[0]["text"], out[1]["token_ids"]
    finally:
        llm.shutdown()
    assert len({*texts.values()}) == 3 and len({tuple(v) for v in ids.values()}) == 3
    a2_json = json.dumps({"name": "a2", "path": a2, "base_model_name": "tiny-parent"})
    args = ("--page-size", "4", "--served-model-name", "tiny", "--enable-lora")
    args += ("--max-loras", "1", "--max-lora-rank", "8", "--lora-modules", f"a1={a1}", a2_json)
    log = str(root / "server.log")
    with run_server(model, *args, log_path=log) as server:
        yield server, texts, ids, (model, a1)
        assert server.wait_idle()["leaked_pages"] == 0


def test_models_lists_adapters_with_parent(setup):
    server, *_ = setup
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert set(cards) == {"tiny", "a1", "a2"}
    assert cards["a1"]["parent"] == "tiny" and cards["a2"]["parent"] == "tiny-parent"
    assert os.path.isdir(cards["a1"]["root"]) and "parent" not in cards["tiny"]


def test_model_picks_the_adapter(setup):
    server, texts, _, _ = setup
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    for name in ["tiny", "a1", "a2", "a1"]:
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=8, temperature=0)
        assert out.choices[0].text == texts["base" if name == "tiny" else name], name
        assert out.model == name
    chat = client.chat.completions.create(
        model="a2", messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0
    )
    assert chat.model == "a2"


def test_generate_lora_path(setup):
    server, _, ids, _ = setup
    for name in ["a2", "a1", None]:
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        body |= {"lora_path": name} if name else {}
        r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["output_ids"] == ids[name or "base"]


def test_unknown_adapter_is_404(setup):
    server, *_ = setup
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt=PROMPT, max_tokens=2)
    assert e.value.code == "model_not_found" and "'nope'" in e.value.message
    body = {"text": PROMPT, "lora_path": "nope"}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_path"
    body = {"text": PROMPT, "lora_path": "a1", "model": "a2"}
    r = httpx.post(f"{server.url}/generate", json=body, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path"


def test_rank_over_max_lora_rank_stops_the_start(setup, tmp_path):
    _, _, _, (model, a1) = setup
    cmd = [sys.executable, "-m", "minisgl", "--model", model, "--port", str(free_port())]
    cmd += ["--enable-lora"]
    cmd += ["--lora-modules", f"a1={a1}", "--max-lora-rank", "4"]
    env = dict(os.environ, PYTHONPATH=os.path.join(REPO, "python"))
    done = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "argument --max-lora-rank: LoRA adapter 'a1'" in done.stderr
    assert "rank 8 is over max_lora_rank 4" in done.stderr


def lora_route(server, action: str, **body):
    return httpx.post(f"{server.url}/v1/{action}_lora_adapter", json=body, timeout=90)


def model_ids(server) -> set[str]:
    return {c["id"] for c in httpx.get(f"{server.url}/v1/models").json()["data"]}


def complete(server, model: str):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    return httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)


def test_load_and_unload_at_runtime(setup):
    """a1's files loaded as "rt" answer as a1 served from --lora-modules; unloaded, a 404."""
    server, texts, _, (_, a1) = setup
    r = lora_route(server, "load", lora_name="rt", lora_path=a1)
    assert r.status_code == 200 and "rt" in r.text, r.text
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert cards["rt"]["parent"] == "tiny" and cards["rt"]["root"] == a1
    assert complete(server, "rt").json()["choices"][0]["text"] == texts["a1"]
    r = lora_route(server, "unload", lora_name="rt", lora_int_id=1)
    assert r.status_code == 200, r.text
    # /flush_cache asks the schedulers through the same helper, its answers kept apart
    assert httpx.post(f"{server.url}/flush_cache", timeout=30).status_code == 200
    assert model_ids(server) == {"tiny", "a1", "a2"}
    r = complete(server, "rt")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = lora_route(server, "unload", lora_name="rt")
    assert r.status_code == 404 and r.json()["error"]["param"] == "lora_name"


def test_bad_loads_change_nothing(setup, tmp_path):
    server, texts, _, (_, a1) = setup
    wide, dora = str(tmp_path / "wide"), str(tmp_path / "dora")
    save_adapter("qwen3", wide, seed=3, r=16)
    shutil.copytree(a1, dora)
    edit_config(dora, use_dora=True)
    bad = [
        ("a1", a1, "lora_name", "already loaded"),
        ("x", str(tmp_path / "missing"), "lora_path", "is not a directory"),
        ("x", wide, "lora_path", "max_lora_rank 8"),
        ("x", dora, "lora_path", "use_dora"),
    ]
    for name, path, field, why in bad:
        r = lora_route(server, "load", lora_name=name, lora_path=path)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field and why in r.json()["error"]["message"]
    r = lora_route(server, "load", lora_name="a1", lora_path=a1, load_inplace=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "load_inplace"
    assert model_ids(server) == {"tiny", "a1", "a2"}
    assert complete(server, "x").status_code == 404
    assert complete(server, "a1").json()["choices"][0]["text"] == texts["a1"]
    # the failed "x" took no name in the scheduler: it loads now, and unloads
    assert lora_route(server, "load", lora_name="x", lora_path=a1).status_code == 200
    assert lora_route(server, "unload", lora_name="x").status_code == 200


def test_unload_waits_for_running_requests(setup):
    """The adapter's long request ends normally; the unload answers once it has."""
    server, _, _, (_, a1) = setup
    assert lora_route(server, "load", lora_name="long", lora_path=a1).status_code == 200
    body = {"model": "long", "prompt": PROMPT, "max_tokens": 400, "ignore_eos": True}
    body |= {"stream": True, "temperature": 0}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=90) as stream:
        lines = stream.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))  # it runs
        r = lora_route(server, "unload", lora_name="long")
        events = [first, *(line for line in lines if line.startswith("data: "))]
    assert r.status_code == 200, r.text
    assert events[-1] == "data: [DONE]"
    ends = [json.loads(e[6:])["choices"][0].get("finish_reason") for e in events[:-1]]
    assert ends[-1] == "length", events[-2]
    assert "long" not in model_ids(server)


def test_routes_need_the_key_and_enable_lora(tmp_path):
    model = make_tiny_model(str(tmp_path / "tiny"))
    args = ("--page-size", "4", "--api-key", "k")
    with run_server(model, *args, log_path=str(tmp_path / "server.log")) as server:
        url = f"{server.url}/v1/load_lora_adapter"
        body = {"lora_name": "a", "lora_path": str(tmp_path)}
        assert httpx.post(url, json=body).status_code == 401
        r = httpx.post(url, json=body, headers={"Authorization": "Bearer k"})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def lora_server(setup, tmp_path, *args: str):
    """A server on the setup's model with a1 served from the start, and `args`."""
    _, _, _, (model, a1) = setup
    lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules")
    lora += (f"a1={a1}",)
    engine = ("--page-size", "4", "--num-pages", "64", "--served-model-name", "tiny")
    return run_server(model, *engine, *lora, *args, log_path=str(tmp_path / "server.log"))


def test_tp2_runtime_changes_reach_every_rank(setup, tmp_path):
    """--tp 2: an adapter loaded at run time answers as the same files served from the start
    and offline (TP 1), so rank 1 loaded it too; once unloaded, the name loads other files
    (rank 1 dropped the first ones: else it would keep computing with them)."""
    _, texts, _, (_, a1) = setup
    a2 = os.path.join(os.path.dirname(a1), "a2")
    with lora_server(setup, tmp_path, "--tp", "2") as server:
        assert "scheduler_1 process started" in server.log()
        assert lora_route(server, "load", lora_name="rt", lora_path=a1).status_code == 200
        for name, expected in [("rt", "a1"), ("a1", "a1"), ("tiny", "base")]:
            r = complete(server, name)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == texts[expected]
        assert lora_route(server, "unload", lora_name="rt").status_code == 200
        r = complete(server, "rt")
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        assert lora_route(server, "load", lora_name="rt", lora_path=a2).status_code == 200
        assert complete(server, "rt").json()["choices"][0]["text"] == texts["a2"]
        assert complete(server, "a1").json()["choices"][0]["text"] == texts["a1"]
        assert lora_route(server, "unload", lora_name="rt").status_code == 200
        assert server.wait_idle()["leaked_pages"] == 0


def test_dp2_runtime_changes_reach_both_replicas(setup, tmp_path):
    """--dp 2: a loaded adapter serves on each replica (`data_parallel_rank`); a bad load
    leaves both without the name (it loads after); an unload drops it from both (the name
    then loads other files on each)."""
    _, _, ids, (_, a1) = setup
    a2 = os.path.join(os.path.dirname(a1), "a2")

    def generate(server, replica: int, name: str):
        body = {"input_ids": IDS, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        body |= {"lora_path": name, "data_parallel_rank": replica}
        return httpx.post(f"{server.url}/generate", json=body, timeout=60)

    with lora_server(setup, tmp_path, "--dp", "2") as server:
        r = lora_route(server, "load", lora_name="rt", lora_path=str(tmp_path / "missing"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text
        assert "rt" not in model_ids(server)
        for path, expected in [(a1, "a1"), (a2, "a2")]:
            r = lora_route(server, "load", lora_name="rt", lora_path=path)
            assert r.status_code == 200, r.text
            for replica in (0, 1):
                r = generate(server, replica, "rt")
                assert r.status_code == 200 and r.json()["output_ids"] == ids[expected], r.text
                assert generate(server, replica, "a1").json()["output_ids"] == ids["a1"]
            assert lora_route(server, "unload", lora_name="rt").status_code == 200
            assert generate(server, 1, "rt").status_code == 404
        assert server.wait_idle()["leaked_pages"] == 0
