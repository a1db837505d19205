"""Checkpoint loading: Hugging Face safetensors (single file or sharded index) into the merged,
TP-sharded parameters; or random 'dummy' weights for benchmarking."""

from __future__ import annotations

import glob
import json
import os
import re
from collections.abc import Collection, Iterator
from typing import TYPE_CHECKING, Any

from safetensors import safe_open

from minisgl.extension import ExtensionMissing, extensions, require
from minisgl.utils.options import OptionError

if TYPE_CHECKING:  # torch where weights are loaded: the processes that only resolve a model's
    # path (tokenizer workers, the API process) do without it
    from torch import nn

# checkpoint name fragment -> (our fragment, shard id) for weights we merge into one matmul
_STACKED = {
    ".q_proj.": (".qkv_proj.", 0), ".k_proj.": (".qkv_proj.", 1), ".v_proj.": (".qkv_proj.", 2),
    ".gate_proj.": (".gate_up_proj.", 0), ".up_proj.": (".gate_up_proj.", 1),
}  # fmt: skip
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SHARD = {"gate_proj": ("w13", 0), "up_proj": ("w13", 1), "down_proj": ("w2", None)}


def resolve_model_path(model: str, option: str = "model") -> str:
    """A local directory as is; a .gguf file through the cpu extension; otherwise a Hugging Face
    hub id, downloaded (cached) once. Else an OptionError against `option`, in one line."""
    if os.path.isdir(model):
        return model
    if model.lower().endswith(".gguf"):  # llama.cpp's single-file format
        convert = extensions().gguf_model
        if convert is None:
            raise OptionError(option, str(ExtensionMissing(f"the GGUF model {model!r}", "cpu")))
        return convert(model)
    if os.path.exists(model):
        raise ValueError(
            f"model path {model!r} is a file, expected a directory with config.json or a .gguf file"
        )
    return _download(model, option)


def default_model() -> str:
    """The model used when none is given: the cpu extension's embedded GGUF, announced."""
    what = "no --model: the embedded default model (SmolLM2-135M-Instruct, a GGUF file)"
    return require(extensions().default_model, what, "cpu")()


def _download(model: str, option: str) -> str:
    from huggingface_hub import errors, snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(model, allow_patterns=patterns)
    except errors.HFValidationError:
        why = "is neither a directory nor a Hugging Face repo id (NAME or ORG/NAME)"
    except errors.GatedRepoError:
        why = "is a gated Hugging Face repository: accept its terms on the hub, then set HF_TOKEN"
    except errors.RepositoryNotFoundError:
        why = "is neither a directory nor a Hugging Face repository (a private one needs HF_TOKEN)"
    except errors.LocalEntryNotFoundError as e:  # no network (or HF_HUB_OFFLINE) and nothing cached
        detail = str(e).splitlines()[0].removeprefix("Got: ") if str(e) else "offline"
        why = "is not a directory, and the Hugging Face hub is unreachable with no copy cached"
        why += f" ({detail})"
    except OSError as e:  # an HTTP error, a full disk
        detail = next((line for line in str(e).splitlines() if line.strip()), type(e).__name__)
        why = f"is not a directory, and the Hugging Face hub could not provide it: {detail}"
    raise OptionError(option, f"{model!r} {why}")


def map_checkpoint_name(name: str) -> tuple[str, Any]:
    """Checkpoint tensor name -> (parameter name, shard id or None)."""
    if m := _EXPERT.search(name):
        target, which = _EXPERT_SHARD[m.group(2)]
        expert = int(m.group(1))
        shard = expert if which is None else (expert, which)
        return name[: m.start()] + f".experts.{target}", shard
    for old, (new, shard_id) in _STACKED.items():
        if old in name:
            return name.replace(old, new), shard_id
    return name, None


def iter_checkpoint(path: str) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice): a rank reads only the rows/columns of its shard."""
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):  # only the files it lists (Mistral's also hold a consolidated copy)
        with open(index) as f:
            files = sorted({os.path.join(path, v) for v in json.load(f)["weight_map"].values()})
    if not files:
        raise ValueError(f"no *.safetensors weights found in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_slice(name)


def load_weights(
    model: nn.Module, weights: Iterator[tuple[str, Any]], skip: Collection[str] = ()
) -> None:
    """Copy the checkpoint into the model's parameters; those in `skip` (replaced by a model
    transform, e.g. by quantized layers) are neither read nor required."""
    import torch

    params = dict(model.named_parameters(remove_duplicate=False))
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = {n for n in params if not (tied and n == "lm_head.weight") and n not in skip}
    for ckpt_name, loaded in weights:
        name, shard = map_checkpoint_name(ckpt_name)
        if name in skip or "rotary_emb.inv_freq" in name or (tied and name == "lm_head.weight"):
            continue
        if name not in params:
            raise ValueError(f"checkpoint tensor {ckpt_name!r} has no matching parameter")
        param = params[name]
        loader = param.weight_loader  # type: ignore[attr-defined]
        with torch.no_grad():
            loader(param, loaded) if shard is None else loader(param, loaded, shard)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")


def init_dummy_weights(model: nn.Module, seed: int = 0) -> None:
    """Random weights with realistic magnitudes: norms at 1, everything else N(0, 0.02)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
                continue
            gen = torch.Generator(device=param.device).manual_seed(seed)
            param.normal_(0.0, 0.02, generator=gen)
            seed += 1
