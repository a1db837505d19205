"""Bad arguments raise a ValueError that names the problem."""

import json
import os
import shutil

import pytest

from minisgl import LLM, SamplingParams
from support.invariants import check_no_leak


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs("llama")[0], page_size=4, num_pages=64)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"max_tokens": -1}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"min_p": 2.0}, "min_p"),
        ({"top_k": -5}, "top_k"),
    ],
)
def test_bad_sampling_params(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context(model_dirs):
    llm = LLM(model_dirs("llama")[0], page_size=4, num_pages=64, max_model_len=32)
    with pytest.raises(ValueError, match="longer than the context"):
        llm.generate([list(range(40))], use_tqdm=False)
    # the pool (8 pages x 4 = 32 tokens) also bounds a request, and the message says so
    small = LLM(model_dirs("llama")[0], page_size=4, num_pages=8)
    with pytest.raises(ValueError, match=r"longer than the KV cache \(32 tokens\)"):
        small.generate([list(range(40))], use_tqdm=False)


def test_bad_prompts(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="prompt: token id"):
        llm.generate([[1, 2, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate(["hello"], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([[1, 2], [3]], [SamplingParams()], use_tqdm=False)
    # nothing was queued by the failed calls
    assert not llm.scheduler.has_work
    check_no_leak(llm.scheduler)


def test_unknown_architecture(model_dirs, tmp_path):
    src = model_dirs("llama")[0]
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="missing config.json"):
        LLM(str(tmp_path))


def test_missing_weights(model_dirs, tmp_path):
    shutil.copy(os.path.join(model_dirs("llama")[0], "config.json"), tmp_path)
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(tmp_path))


def test_bad_engine_options(model_dirs):
    path = model_dirs("llama")[0]
    with pytest.raises(ValueError, match="page_size"):
        LLM(path, page_size=0)
    with pytest.raises(ValueError, match="cache"):
        LLM(path, cache="lru")
    with pytest.raises(ValueError, match="attention backend"):
        LLM(path, attn="nope")
