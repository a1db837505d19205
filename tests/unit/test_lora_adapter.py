"""ext/lora's adapter reading: PEFT's names mapped onto minisgl's merged projections with
PEFT's scaling, and every adapter the serving path cannot use refused with an error naming the
adapter and the reason; --lora-modules parsing."""

from __future__ import annotations

import math
import os

import pytest
from safetensors.torch import load_file, save_file

from minisgl.ext.lora.adapter import AdapterError, load_adapter
from minisgl.ext.lora.options import LoraOptions, parse_lora_module
from minisgl.models.config import ModelConfig
from minisgl.models.hf import load_hf_config
from minisgl.utils.options import OptionError
from support.lora import edit_config, save_adapter

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def qwen3(model_dirs):
    return ModelConfig.from_hf(load_hf_config(model_dirs("qwen3")[0]))


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A qwen3 adapter of q/v/down, rslora, v at rank 2 and down at alpha 3."""
    path = str(tmp_path_factory.mktemp("good"))
    save_adapter(
        "qwen3",
        path,
        seed=1,
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "down_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3},
    )
    return path


@pytest.fixture
def copy(good, tmp_path):
    """A copy of the good adapter to spoil."""
    for name in os.listdir(good):
        (tmp_path / name).write_bytes(open(os.path.join(good, name), "rb").read())
    return str(tmp_path)


def test_names_ranks_and_scaling_as_peft(good, qwen3):
    adapter = load_adapter("good", good, qwen3, max_rank=8)
    assert sorted({m for _, m in adapter.weights}) == ["down_proj", "q_proj", "v_proj"]
    assert {layer for layer, _ in adapter.weights} == {0, 1}
    q, v, down = (adapter.weights[(0, m)] for m in ("q_proj", "v_proj", "down_proj"))
    assert (q.rank, v.rank, down.rank, adapter.rank) == (4, 2, 4, 4)
    assert q.scaling == pytest.approx(8 / math.sqrt(4))
    assert v.scaling == pytest.approx(8 / math.sqrt(2))
    assert down.scaling == pytest.approx(3 / math.sqrt(4))
    assert tuple(q.a.shape) == (4, 64) and tuple(q.b.shape) == (4 * 32, 4)
    assert adapter.layer_parts(0, "qkv_proj")[1] is None  # k_proj: not adapted
    assert len(adapter.layer_parts(1, "gate_up_proj")) == 2


def test_hub_id_goes_through_snapshot_download(good, qwen3, monkeypatch):
    import huggingface_hub

    calls = []

    def fake(repo, allow_patterns):
        calls.append((repo, allow_patterns))
        return good

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    adapter = load_adapter("hub", "someone/some-adapter", qwen3, max_rank=8)
    assert adapter.path == good and calls[0][0] == "someone/some-adapter"
    assert "adapter_model.safetensors" in calls[0][1]

    def offline(repo, allow_patterns):
        raise OSError("We couldn't connect to the hub")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(AdapterError, match="'hub'.*could not provide it: We couldn't connect"):
        load_adapter("hub", "someone/some-adapter", qwen3, max_rank=8)


def _spoil_tensors(path: str, change) -> None:
    tensors = load_file(os.path.join(path, WEIGHTS))
    save_file(change(tensors), os.path.join(path, WEIGHTS))


def _renamed(old: str, new: str):
    return lambda t: {k.replace(old, new): v for k, v in t.items()}


BAD = {
    "rank": (None, None, "rank 4 is over max_lora_rank 3"),
    "unknown target": (dict(target_modules=["q_proj", "fc1"]), None, r"\['fc1'\] are not among"),
    "embedding target": (dict(target_modules=["embed_tokens"]), None, "embedding or the LM head"),
    "dora": (dict(use_dora=True), None, "DoRA"),
    "bias": (dict(bias="lora_only"), None, "trained biases"),
    "modules_to_save": (dict(modules_to_save=["lm_head"]), None, "modules_to_save"),
    "not lora": (dict(peft_type="IA3"), None, "peft_type 'IA3' is not LORA"),
    "moe expert": (
        None,
        _renamed("mlp.down_proj", "mlp.experts.3.down_proj"),
        "mixture-of-experts experts",
    ),
    "layer": (None, _renamed("layers.1.", "layers.7."), "layer 7, but the model has 2 layers"),
    "unpaired": (
        None,
        lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" not in k},
        "layer 0 q_proj has no lora_B",
    ),
    "shape": (
        None,
        lambda t: {k: v[:, :10].contiguous() if "q_proj.lora_A" in k else v for k, v in t.items()},
        r"expected A \(4, 64\) and B \(128, 4\) for this model, got A \(4, 10\)",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_adapters_are_refused_naming_why(copy, qwen3, case):
    config, tensors, message = BAD[case]
    if config is not None:
        edit_config(copy, **config)
    if tensors is not None:
        _spoil_tensors(copy, tensors)
    max_rank = 3 if case == "rank" else 8
    with pytest.raises(AdapterError, match=f"LoRA adapter 'x' .*{message}"):
        load_adapter("x", copy, qwen3, max_rank)


def test_missing_files_and_pickles_are_refused(copy, qwen3, tmp_path_factory):
    os.rename(os.path.join(copy, WEIGHTS), os.path.join(copy, "adapter_model.bin"))
    with pytest.raises(AdapterError, match="adapter_model.bin is a pickle"):
        load_adapter("x", copy, qwen3, 8)
    os.remove(os.path.join(copy, "adapter_model.bin"))
    with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
        load_adapter("x", copy, qwen3, 8)
    empty = str(tmp_path_factory.mktemp("empty"))
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        load_adapter("x", empty, qwen3, 8)
    with pytest.raises(AdapterError, match="is a file, expected a directory"):
        load_adapter("x", os.path.join(copy, "adapter_config.json"), qwen3, 8)


def test_an_adapter_of_another_model_is_refused(model_dirs, good):
    llama = ModelConfig.from_hf(load_hf_config(model_dirs("llama")[0]))  # head_dim 16, not 32
    with pytest.raises(AdapterError, match="another base model"):
        load_adapter("x", good, llama, 8)


def test_lora_modules_forms():
    assert parse_lora_module("sql=/ad/sql").path == "/ad/sql"
    spec = parse_lora_module('{"name": "a", "path": "org/a", "base_model_name": "base"}')
    assert (spec.name, spec.path, spec.base_model_name) == ("a", "org/a", "base")
    for bad in ("noequals", "=path", "name=", '{"name": "a"}', '{"name": "a", "path": 1}', "{x"):
        with pytest.raises(OptionError) as e:
            parse_lora_module(bad)
        assert e.value.name == "lora_modules"
    with pytest.raises(OptionError, match=r"\['a'\] given more than once"):
        LoraOptions(True, ("a=x", "a=y")).check()
    with pytest.raises(OptionError, match="max_cpu_loras"):
        LoraOptions(True, max_loras=4, max_cpu_loras=2).check()
    with pytest.raises(OptionError, match="needs enable_lora"):
        LoraOptions(False, ("a=x",)).check()
    assert LoraOptions(True, max_loras=3).cpu_loras == 3
