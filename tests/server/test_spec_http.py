"""Speculative decoding through the server: streamed and whole responses equal plain decoding
(offline, no speculation), and /metrics counts the proposals."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from minisgl import LLM, SamplingParams
from support.server import make_tiny_model, run_server

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes in /proc")
PROMPT = [7, 8, 9, 10] * 5 + [7, 8]


def test_ngram_server_streams_what_plain_decoding_gives(tmp_path) -> None:
    model = make_tiny_model(str(tmp_path / "tiny"))
    llm = LLM(model, page_size=4)
    try:
        want = llm.generate([PROMPT], SamplingParams(max_tokens=24), use_tqdm=False)[0]
    finally:
        llm.shutdown()
    args = ("--page-size", "4", "--speculative-algorithm", "ngram")
    with run_server(model, *args, log_path=str(tmp_path / "server.log")) as server:
        body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0}
        whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert whole["choices"][0]["text"] == want["text"]
        assert whole["usage"]["completion_tokens"] == len(want["token_ids"])
        pieces = []
        url = f"{server.url}/v1/completions"
        with httpx.stream("POST", url, json=body | {"stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    pieces.append(json.loads(line[6:])["choices"][0]["text"])
        assert "".join(pieces) == want["text"]
        metrics = httpx.get(f"{server.url}/metrics").text
        values = {
            line.split()[0]: float(line.split()[1])
            for line in metrics.splitlines()
            if line.startswith("minisgl_spec_")
        }
        assert values["minisgl_spec_accepted_tokens_total"] > 0
        assert (
            values["minisgl_spec_draft_tokens_total"]
            >= values["minisgl_spec_accepted_tokens_total"]
        )
        assert server.wait_idle()["leaked_pages"] == 0
