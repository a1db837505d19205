"""PEFT LoRA adapters: read from a directory or a Hugging Face hub id, checked against the
base model, mapped onto minisgl's projections.

An adapter is `adapter_config.json` + `adapter_model.safetensors` as PEFT's `save_pretrained`
writes them. Its tensors are named after the Hugging Face modules,
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` ([r, in]) and `...lora_B.weight`
([out, r]); a module's update is W' = W + scaling * B @ A with scaling = lora_alpha / r
(rslora: lora_alpha / sqrt(r)), r and alpha per module through `rank_pattern` /
`alpha_pattern` as PEFT matches them. minisgl merges q/k/v into `qkv_proj` and gate/up into
`gate_up_proj`; `TARGETS` says where each part goes (`weights.py` writes them there, sharded
like the layer).

Supported: LoRA on q/k/v/o/gate/up/down_proj of the dense layers (target_modules a list of
those names, a regex over module names, or PEFT's "all-linear"), rank up to max_lora_rank,
rslora, per-module rank and alpha. Refused with an `AdapterError` naming the adapter and the
reason, because the serving path has no place for them: other PEFT methods, DoRA
(`use_dora`), trained biases (`bias` other than "none", `lora_bias`), `modules_to_save` and
trainable tokens (they replace whole modules or embedding rows), embedding or LM-head targets,
MoE experts and routers, layer replication, `fan_in_fan_out` (Conv1D layers, which these
models do not have), pickled `.bin` weights (arbitrary code on load)."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from minisgl.models.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# Hugging Face module -> (minisgl module, slice of it): q/k/v are the merged qkv_proj's three
# row blocks, gate/up the two of gate_up_proj
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "o_proj": ("o_proj", 0),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
    "down_proj": ("down_proj", 0),
}
# minisgl module -> its parts in slice order
MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_PREFIX = "base_model.model."
_TENSOR = re.compile(r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")
# config keys whose feature is refused when set (PEFT's "off" values are all falsy)
_REFUSED = {
    "use_dora": "DoRA (use_dora) is not supported",
    "lora_bias": "trained LoRA biases (lora_bias) are not supported",
    "modules_to_save": "modules_to_save (whole replaced modules) is not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "layer_replication": "layer_replication is not supported",
    "target_parameters": "target_parameters (e.g. MoE expert weights) is not supported",
    "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    "use_qalora": "QALoRA (use_qalora) is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
}
_EMBEDDINGS = ("embed_tokens", "lm_head")


# raises the AdapterError (or the subclass given) naming the adapter and the reason
Fail = Callable[..., NoReturn]


class AdapterError(ValueError):
    """An adapter that cannot be used with this model: the message names it and the reason."""


class RankTooLarge(AdapterError):
    """An adapter whose rank is over max_lora_rank (the start names --max-lora-rank)."""


@dataclass
class LoraWeights:
    """One Hugging Face module's update: A [r, in], B [out, r], W' = W + scaling * B @ A."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass
class LoraAdapter:
    """A checked adapter on the host: `weights[(layer, hf module)]` for the modules it adapts
    (hf module: a key of TARGETS); absent ones are unchanged."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    weights: dict[tuple[int, str], LoraWeights] = field(default_factory=dict)

    def layer_parts(self, layer: int, module: str) -> list[LoraWeights | None]:
        """minisgl module `module` of `layer`: its parts' updates in slice order (None: none)."""
        return [self.weights.get((layer, part)) for part in MODULES[module]]


def resolve_adapter_path(name: str, path: str) -> str:
    """A local directory as is, else a hub id downloaded (cached) with huggingface_hub."""
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise AdapterError(f"LoRA adapter {name!r}: {path!r} is a file, expected a directory")
    from huggingface_hub import snapshot_download

    try:
        patterns = [CONFIG_FILE, WEIGHTS_FILE, "adapter_model.bin"]
        return snapshot_download(path, allow_patterns=patterns)
    except Exception as e:  # HFValidationError, RepositoryNotFoundError, offline, HTTP errors
        first = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        why = f"is not a directory, and the Hugging Face hub could not provide it: {first}"
        raise AdapterError(f"LoRA adapter {name!r}: {path!r} {why}") from None


def load_adapter(name: str, path: str, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check the PEFT adapter at `path` (a directory or a hub id) for `model`."""
    where = resolve_adapter_path(name, path)
    fail = _failer(name, where)
    config = _read_config(where, fail)
    _check_config(config, fail)
    tensors = _read_tensors(where, fail)
    adapter = LoraAdapter(name, where, 0)
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        layer, module, kind = _parse_name(key, model, fail)
        pairs.setdefault((layer, module), {})[kind] = tensor
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            missing = "A" if "A" not in pair else "B"
            fail(f"layer {layer} {module} has no lora_{missing} (each lora_A needs its lora_B)")
        a, b = pair["A"], pair["B"]
        _check_shapes(layer, module, a, b, model, max_rank, fail)
        scaling = _scaling(config, f"model.layers.{layer}.{_block(module)}.{module}", a.shape[0])
        adapter.weights[(layer, module)] = LoraWeights(a, b, scaling)
        adapter.rank = max(adapter.rank, a.shape[0])
    if not adapter.weights:
        fail("it has no LoRA weights")
    return adapter


def inspect_adapter(name: str, path: str, max_rank: int) -> str:
    """What can be checked of an adapter without the model (its config, its tensors' names and
    ranks: RankTooLarge over `max_rank`), before any engine starts; -> its local directory
    (a hub id downloaded)."""
    where = resolve_adapter_path(name, path)
    fail = _failer(name, where)
    _check_config(_read_config(where, fail), fail)
    for key, tensor in _read_tensors(where, fail).items():
        if key.endswith("lora_A.weight") and tensor.dim() == 2 and tensor.shape[0] > max_rank:
            fail(f"{key}: rank {tensor.shape[0]} is over max_lora_rank {max_rank}", RankTooLarge)
    return where


def _failer(name: str, where: str) -> Fail:
    def fail(reason: str, kind: type[AdapterError] = AdapterError) -> NoReturn:
        raise kind(f"LoRA adapter {name!r} ({where}): {reason}")

    return fail


def _read_config(where: str, fail: Fail) -> dict[str, Any]:
    file = os.path.join(where, CONFIG_FILE)
    if not os.path.isfile(file):
        fail(f"no {CONFIG_FILE} (not a PEFT adapter)")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"unreadable {CONFIG_FILE}: {e}")
    if not isinstance(config, dict):
        fail(f"{CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict[str, Any], fail: Fail) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        fail(f"peft_type {config['peft_type']!r} is not LORA")
    for key, why in _REFUSED.items():
        if config.get(key):
            fail(why)
    if config.get("bias", "none") != "none":
        fail(f"bias {config['bias']!r} (trained biases) is not supported: only 'none'")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) and targets == "all-linear" else targets
    if isinstance(names, list):
        if any(n in _EMBEDDINGS for n in names):
            fail("LoRA on the embedding or the LM head is not supported")
        if unknown := sorted(set(names) - set(TARGETS) - {"all-linear"}):
            fail(f"target_modules {unknown} are not among {', '.join(TARGETS)} (or all-linear)")
    elif not isinstance(targets, str):  # a string other than all-linear is PEFT's regex
        fail(f"target_modules {targets!r} is neither a list of module names nor a regex")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            fail(f"{key} {value!r} is not a positive number")


def _read_tensors(where: str, fail: Fail) -> dict[str, torch.Tensor]:
    file = os.path.join(where, WEIGHTS_FILE)
    if not os.path.isfile(file):
        if os.path.isfile(os.path.join(where, "adapter_model.bin")):
            fail(
                "adapter_model.bin is a pickle, which can run code when loaded: save the adapter "
                "as safetensors (PEFT's save_pretrained does by default)"
            )
        fail(f"no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(file)
    except (SafetensorError, OSError) as e:
        fail(f"unreadable {WEIGHTS_FILE}: {e}")


def _parse_name(key: str, model: ModelConfig, fail: Fail) -> tuple[int, str, str]:
    """A tensor name -> (layer, hf module, "A" or "B"), or the reason it cannot be served."""
    name = key.removeprefix(_PREFIX)
    if ".experts." in name or ".shared_expert" in name or name.endswith("mlp.gate.lora_A.weight"):
        fail(f"{key}: LoRA on mixture-of-experts experts or routers is not supported")
    if "lora_embedding" in name or any(e in name for e in _EMBEDDINGS):
        fail(f"{key}: LoRA on the embedding or the LM head is not supported")
    if "lora_magnitude_vector" in name:
        fail(f"{key}: DoRA is not supported")
    m = _TENSOR.fullmatch(name)
    if m is None or m.group(3) not in TARGETS or _block(m.group(3)) != m.group(2):
        fail(f"{key}: not a LoRA weight of {', '.join(TARGETS)} in a decoder layer")
    layer = int(m.group(1))
    if layer >= model.num_layers:
        fail(f"{key}: layer {layer}, but the model has {model.num_layers} layers")
    if model.moe is not None and m.group(2) == "mlp" and layer in model.moe.sparse_layers:
        fail(f"{key}: layer {layer}'s MLP is a mixture of experts; LoRA on experts is refused")
    return layer, m.group(3), m.group(4)


def _block(module: str) -> str:
    return "mlp" if module in ("gate_proj", "up_proj", "down_proj") else "self_attn"


def module_shape(module: str, model: ModelConfig) -> tuple[int, int]:
    """(in, out) features of Hugging Face module `module` in the unsharded model."""
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    h, i = model.hidden_size, model.intermediate_size
    shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    shapes.update(gate_proj=(h, i), up_proj=(h, i), down_proj=(i, h))
    return shapes[module]


def _check_shapes(
    layer: int,
    module: str,
    a: torch.Tensor,
    b: torch.Tensor,
    model: ModelConfig,
    max_rank: int,
    fail: Fail,
) -> None:
    where = f"layer {layer} {module}"
    if a.dim() != 2 or b.dim() != 2:
        fail(f"{where}: lora_A / lora_B are not matrices")
    r = a.shape[0]
    if r > max_rank:
        fail(f"{where}: rank {r} is over max_lora_rank {max_rank}", RankTooLarge)
    fan_in, fan_out = module_shape(module, model)
    if tuple(a.shape) != (r, fan_in) or tuple(b.shape) != (fan_out, r):
        expected = f"A {(r, fan_in)} and B {(fan_out, r)}"
        got = f"A {tuple(a.shape)} and B {tuple(b.shape)}"
        fail(f"{where}: expected {expected} for this model, got {got} (another base model?)")
    if not (a.is_floating_point() and b.is_floating_point()):
        fail(f"{where}: weights are not floating point")


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key matching the module name's end
    (as peft.utils.other.get_pattern_key)."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(config: dict[str, Any], module: str, rank: int) -> float:
    """scaling of `module` (e.g. model.layers.0.self_attn.q_proj) whose A has `rank` rows."""
    alpha = _pattern_value(config.get("alpha_pattern", {}), module, config["lora_alpha"])
    return alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
