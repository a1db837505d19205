"""`--quantization`: give a model's projections (and LM head) weight-only quantized layers
(`quantized.py`), as the cpu extension's `model_transform` (`CpuModelTransform`).

- `gguf`, before the checkpoint loads: from a GGUF's own blocks (`gguf_quant.py`). Where
  minisgl's kernel runs (`native.py`: AVX512-VNNI, AVX-VNNI or AVX2), a projection whose
  parts are all quantized becomes a `VnniLinear` (the file's codes and float16 scales; the
  K-quants' factors of theirs, where every part is a K-quant).
  Elsewhere a projection whose parts are all Q4_0 / Q4_1 / Q4_K becomes an `Int4Linear` with
  the file's codes (when its rows are a multiple of 16, as the packing needs); one whose parts
  are all quantized otherwise (Q8_0, Q5s, or those with 4-bit parts) an `Int8SplitLinear`,
  again with the file's codes (an `Int8Linear` quantized per row from the exact float32 values
  where the rows do not fit the packing); one with a float part stays dense. The quantized
  layers, with the dense weights that the GGUF holds quantized (the embedding beside a tied LM
  head), are cached next to the converted checkpoint (`packed-...st`, per torch version and
  dtype), so later starts read them without packing and without the GGUF, and no float32 copy
  of a quantized tensor is written.
- `int8`, after loading: every projection an `Int8Linear`, quantized per row from the loaded
  weights; it, like every path but `gguf`, loads the float32 copy of the GGUF's quantized
  tensors, written at its first need (`gguf.ensure_float_copy`).
The embedding table stays dense (a lookup reads one row per token). The core's layers know
nothing of this: each projection gets a `quantized` member (None: dense) and, when quantized,
instance attributes `forward` / `matmul` that compute through it (`route_through`)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from minisgl.distributed import get_tp_info
from minisgl.ext.cpu import native
from minisgl.ext.cpu.gguf import conversion_size, dense_names, ensure_float_copy, prune_unused
from minisgl.ext.cpu.gguf_quant import BLOCK, FOUR_BIT, OFFSETS, Blocks, KScales, load_blocks
from minisgl.ext.cpu.options import cpu_options
from minisgl.ext.cpu.packed import pack_float_projections
from minisgl.ext.cpu.policy import announce, resolve_quantization
from minisgl.ext.cpu.quantized import (
    INT4_OFFSET,
    Int4Linear,
    Int8Linear,
    Int8SplitLinear,
    QuantizedLinear,
    VnniLinear,
    int4_fits,
)
from minisgl.ext.cpu.routes import projections, route_through
from minisgl.ext.cpu.threads import set_cpu_threads
from minisgl.layers.linear import LinearBase
from minisgl.models.weight import load_weights, map_checkpoint_name

_MERGED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_CACHE_FORMAT = 9  # bump when the cached layers change
_DENSE = "dense/"  # the cache's keys of the checkpoint tensors kept dense (in the dtype)
_KINDS: tuple[type[QuantizedLinear], ...] = (Int4Linear, Int8Linear, Int8SplitLinear, VnniLinear)


def checkpoint_parts(name: str, tied: bool) -> list[str]:
    """The checkpoint weights merged into module `name` (in order)."""
    if name == "lm_head" and tied:
        return ["model.embed_tokens.weight"]
    prefix, _, leaf = name.rpartition(".")
    prefix = f"{prefix}." if prefix else ""  # an untied `lm_head`: at the top level
    return [f"{prefix}{part}.weight" for part in _MERGED.get(leaf, (leaf,))]


def int4_from_blocks(parts: list[Blocks], dtype: torch.dtype) -> Int4Linear:
    """Q4_0 / Q4_1 / Q4_K blocks (rows concatenated) as torch's int4 layout, codes unchanged:
    Q4_0 w = d (q - 8): scale d, zero 0; Q4_1, Q4_K w = d q + m = d (q - 8) + (m + 8 d)."""
    codes = torch.cat([b.codes for b in parts])
    scales = torch.cat([b.scales.float() for b in parts])
    zeros = torch.cat(
        [
            torch.zeros_like(b.scales.float())
            if b.mins is None
            else b.mins.float() + INT4_OFFSET * b.scales.float()
            for b in parts
        ]
    )
    return Int4Linear.pack(codes, scales.to(dtype), zeros.to(dtype))


def split_from_blocks(parts: list[Blocks], dtype: torch.dtype) -> Int8SplitLinear:
    """Blocks of any kind (rows concatenated) as signed 8-bit codes, w = d c + m, codes
    unchanged: Q8_0 c = q; Q4_0 c = q - 8, Q5_0 c = q - 16; the others c = q, m its minimum."""
    codes = torch.cat([b.codes.to(torch.int32) - OFFSETS.get(b.kind, 0) for b in parts])
    scales = torch.cat([b.scales.float() for b in parts])
    mins = torch.cat(
        [torch.zeros_like(b.scales.float()) if b.mins is None else b.mins.float() for b in parts]
    )
    return Int8SplitLinear.split(codes, scales, mins, dtype)


def per_16(blocks: Blocks) -> bool:
    """Whether the blocks' scales are per 16 weights (Q6_K's), not per 32."""
    return blocks.scales.shape[1] * 16 == blocks.codes.shape[1]


def vnni_from_blocks(parts: list[Blocks], four_bit: bool) -> VnniLinear | None:
    """Blocks (rows concatenated) in `VnniLinear`'s forms, the file's codes and float16 scales:
    four-bit parts w = d q + mn (Q4_1, Q4_K: its min; Q4_0: -8 d), or w = d (q - 8) with no mn
    row when all are Q4_0; where a part has a scale per 16 weights (Q6_K), six-bit codes u = c +
    32 with c as in `split_from_blocks` and every part's d per 16, w = d (u - 32) + mn (d sc
    rounded once to float16; None with a Q8_0 part, whose codes do not fit); otherwise
    eight-bit codes u = c + 128, w = d (u - 128) + mn (a part's min; no mn row where every mn
    is 0). None too where a scale is past float16's range. Parts all K-quants (Q4_K, Q5_K,
    Q6_K) keep their factors instead, exact (`VnniLinear.tile_k`)."""
    halves = any(per_16(b) for b in parts)
    if halves and any(b.kind == "Q8_0" for b in parts):
        return None
    bits = 4 if four_bit else 6 if halves else 8
    if four_bit:
        codes = torch.cat([b.codes for b in parts])
    else:
        bias = 32 if halves else 128
        codes = torch.cat([b.codes.to(torch.int32) + bias - OFFSETS.get(b.kind, 0) for b in parts])
    factors = [b.k for b in parts if b.k is not None]
    if len(factors) == len(parts):
        return VnniLinear.tile_k(codes, merged_factors(parts, factors, halves), bits)
    zeros = [torch.zeros(b.codes.shape[0], b.codes.shape[1] // BLOCK) for b in parts]
    if four_bit:
        mins = [-OFFSETS[b.kind] * b.scales if b.kind in OFFSETS else b.mins for b in parts]
    else:
        mins = [b.mins for b in parts]
    minimum = torch.cat([z if m is None else m.float() for m, z in zip(mins, zeros)])
    widen = [1 if per_16(b) or not halves else 2 for b in parts]
    scales = torch.cat([b.scales.float().repeat_interleave(n, 1) for b, n in zip(parts, widen)])
    if not torch.isfinite(scales.half()).all():  # a d sc past float16's range: dense, not inf
        return None
    symmetric = all(b.kind == "Q4_0" for b in parts) if four_bit else not minimum.any()
    return VnniLinear.tile(codes, scales, None if symmetric else minimum, bits)


def merged_factors(parts: list[Blocks], factors: list[KScales], halves: bool) -> KScales:
    """The K-quant parts' factors, rows concatenated: sc per 32 weights repeated for each 16
    where `halves`; m_scale and m zeros for the parts without (Q6_K), none if no part has them."""
    sc = [
        f.sc.repeat_interleave(1 if per_16(b) or not halves else 2, 1)
        for b, f in zip(parts, factors)
    ]
    d = torch.cat([f.d for f in factors])
    if all(f.m is None for f in factors):
        return KScales(d, torch.cat(sc))
    m_scale = [torch.zeros_like(f.d) if f.m_scale is None else f.m_scale for f in factors]
    blocks = [b.codes.shape[1] // BLOCK for b in parts]
    m = [
        torch.zeros(f.d.shape[0], n, dtype=torch.int8) if f.m is None else f.m
        for f, n in zip(factors, blocks)
    ]
    return KScales(d, torch.cat(sc), torch.cat(m_scale), torch.cat(m))


def from_blocks(parts: list[Blocks | None], dtype: torch.dtype) -> QuantizedLinear | None:
    """A projection's layer from its parts' GGUF blocks; None when a part is not quantized, or
    has scales per 16 weights (Q6_K) where minisgl's kernel does not run (or beside Q8_0)."""
    blocks = [b for b in parts if b is not None]
    if not blocks or len(blocks) != len(parts):
        return None
    rows, cols = sum(b.codes.shape[0] for b in blocks), blocks[0].codes.shape[1]
    four_bit = all(b.kind in FOUR_BIT for b in blocks)
    if VnniLinear.fits(rows, cols):
        return vnni_from_blocks(blocks, four_bit)
    if any(per_16(b) for b in blocks):  # torch's int4 kernel takes groups of 32 and more
        return None
    if four_bit and int4_fits(rows, cols, BLOCK):
        return int4_from_blocks(blocks, dtype)
    if int4_fits(rows, 2 * cols, BLOCK):
        return split_from_blocks(blocks, dtype)
    return Int8Linear.from_float(torch.cat([b.dequantize() for b in blocks]), dtype)


def _attach(model: nn.Module, layers: dict[str, QuantizedLinear]) -> set[str]:
    """Give every projection its quantized layer (None where it stays dense); -> the parameter
    names no longer used."""
    dropped = set()
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    for name, module in projections(model):
        layer = layers.get(name)
        module.quantized = layer  # type: ignore[assignment]
        if layer is not None:
            route_through(module, layer.matmul)
        # the dense weight goes (not a tied LM head's: it is the embedding's too)
        if layer is not None and (isinstance(module, LinearBase) or not tied):
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            module.weight = nn.Parameter(weight.new_empty(0), requires_grad=False)
            dropped.add(f"{name}.weight")
    return dropped


def cache_file(model_dir: str, dtype: torch.dtype) -> str:
    """Per format, dtype, torch version and kernel family (minisgl's own or torch's)."""
    version = torch.__version__.replace("+", "-")
    name = str(dtype).removeprefix("torch.")
    family = "vnni" if native.native_kernel() is not None else "torch"
    return os.path.join(model_dir, f"packed-{_CACHE_FORMAT}-{family}-{name}-torch{version}.st")


def _load_cached(path: str) -> tuple[dict[str, QuantizedLinear], dict[str, torch.Tensor]]:
    """-> (module name -> its layer, checkpoint name -> a dense weight)."""
    from safetensors.torch import load_file

    # the layers' copies: the kernels' vector loads want aligned memory, which tensors straight
    # out of a safetensors file need not be (a segfault in _weight_int8pack_mm otherwise)
    tensors = load_file(path)
    dense = {k.removeprefix(_DENSE): t for k, t in tensors.items() if k.startswith(_DENSE)}
    tensors = {k: t.clone() for k, t in tensors.items() if not k.startswith(_DENSE)}
    layers: dict[str, QuantizedLinear] = {}
    for key in tensors:
        name, _, buf = key.rpartition(".")
        if buf == "kind":
            prefix = f"{name}."
            state = {k.removeprefix(prefix): t for k, t in tensors.items() if k.startswith(prefix)}
            layers[name] = _KINDS[int(tensors[key][0])].from_state(state)
    return layers, dense


def _save_cached(
    path: str, layers: dict[str, QuantizedLinear], dense: dict[str, torch.Tensor]
) -> None:
    from safetensors.torch import save_file

    tensors = {f"{n}.{k}": t for n, layer in layers.items() for k, t in layer.state_dict().items()}
    for name, layer in layers.items():
        tensors[f"{name}.kind"] = torch.tensor([_KINDS.index(type(layer))], dtype=torch.uint8)
    tensors.update({_DENSE + name: t.contiguous() for name, t in dense.items()})
    tmp = f"{path}.tmp-{os.getpid()}"
    try:  # a read-only cache only costs the packing at every start
        save_file(tensors, tmp)
        os.replace(tmp, path)
    except OSError:
        if os.path.exists(tmp):
            os.remove(tmp)
        return
    size = f"{os.path.getsize(path) / 1e6:.0f} MB"
    entry = conversion_size(os.path.dirname(path))
    print(f"minisgl: cached the packed layers ({size}) in {entry}", file=sys.stderr)


def _load_dense(
    model: nn.Module, tensors: dict[str, torch.Tensor], in_files: list[str]
) -> set[str]:
    """Loads the dense weights whose tensors the GGUF holds quantized (not in the checkpoint's
    files); -> the parameters they fill whole, which the files' loading skips."""
    targets = {map_checkpoint_name(name)[0] for name in tensors}
    others = {n for n, _ in model.named_parameters(remove_duplicate=False)} - targets
    load_weights(model, iter(tensors.items()), skip=others)
    return targets - {map_checkpoint_name(name)[0] for name in in_files}


def prune_packed(path: str) -> None:
    """Marks the packed file in use and removes the entry's others (an earlier format, the
    other kernel family, another torch or dtype) unused for a week (`gguf.prune_unused`, as
    `aot.prune` does its artifacts): an upgrade does not leave the old file beside the new one."""
    try:
        os.utime(path)
    except OSError:
        return  # a read-only cache: nothing to tidy either
    prune_unused(os.path.dirname(path), "packed-*.st", {os.path.basename(path)})


def quantize_gguf(model: nn.Module, model_dir: str, dtype: torch.dtype) -> set[str]:
    """`gguf` mode, before loading: quantized layers, and the dense weights the GGUF holds
    quantized, from the cache or the GGUF's blocks; -> the parameter names that loading must
    skip."""
    path = cache_file(model_dir, dtype)
    if os.path.isfile(path):
        layers, dense = _load_cached(path)
        dropped = _attach(model, layers)
    else:
        blocks = load_blocks(model_dir)
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        layers = {}
        for name, _ in projections(model):
            layer = from_blocks([blocks.get(p) for p in checkpoint_parts(name, tied)], dtype)
            if layer is not None:
                layers[name] = layer
        dropped = _attach(model, layers)
        dense = {
            name: b.dequantize().to(dtype)  # bit for bit the float32 copy's values, rounded
            for name, b in blocks.items()
            if map_checkpoint_name(name)[0] not in dropped
        }
        _save_cached(path, layers, dense)
    prune_packed(path)
    return dropped | _load_dense(model, dense, dense_names(model_dir))


def quantize_int8(model: nn.Module, dtype: torch.dtype) -> None:
    """`int8` mode, after loading: every projection per-row int8 from its loaded weight."""
    layers: dict[str, QuantizedLinear] = {}
    with torch.no_grad():
        for name, module in projections(model):
            weight = module.weight
            assert isinstance(weight, torch.Tensor)
            layers[name] = Int8Linear.from_float(weight, dtype)
    _attach(model, layers)


def count_quantized(model: nn.Module) -> int:
    return sum(getattr(m, "quantized", None) is not None for _, m in projections(model))


@dataclass
class CpuModelTransform:
    """The `model_transform` of a cpu engine at TP 1 (a `minisgl.extension.ModelTransform`):
    the `--quantization` mode's layers, then the start line."""

    name: str  # the resolved --quantization: none / gguf / int8
    model_dir: str
    dtype: torch.dtype
    compiled: bool  # --enable-torch-compile, for the start line

    def before_load(self, model: nn.Module) -> set[str]:
        if self.name == "gguf":  # first: the dense copies of its weights are not read
            return quantize_gguf(model, self.model_dir, self.dtype)
        return _attach(model, {})  # every projection dense

    def after_load(self, model: nn.Module) -> None:
        if self.name == "int8":
            quantize_int8(model, self.dtype)
        elif self.name == "none" and self.dtype == torch.float32:
            pack_float_projections(model)  # oneDNN on weights packed once (packed.rule_for)
        entry = conversion_size(self.model_dir)
        kernel = any(isinstance(m, VnniLinear) for m in model.modules())
        how = f"{self.name}, {native.wanted()} kernel" if kernel else self.name
        announce(self.dtype, how, count_quantized(model), self.compiled, entry)


def model_transform(engine: Any) -> CpuModelTransform | None:
    """The `model_transform` point, for an engine being built (`engine.Engine`: device, dtype,
    model path, config): on cpu at TP 1 the transform of its `--quantization`; elsewhere None
    (the mode is none there: auto resolves to it and an explicit mode is refused). It sets the
    starting thread count (`threads.set_cpu_threads`)."""
    tp, device, dtype, path = get_tp_info().size, engine.device, engine.dtype, engine.model_path
    options = cpu_options(engine.config)
    mode = resolve_quantization(options.quantization, device, dtype, path, tp)
    if mode != "gguf" and not engine.config.dummy_weights:
        ensure_float_copy(path)  # a GGUF's quantized tensors, dequantized: once, if not yet
    set_cpu_threads(engine.config, every_core=device.type == "cpu" and tp == 1)
    if device.type != "cpu" or tp != 1:
        return None
    return CpuModelTransform(mode, path, dtype, options.enable_torch_compile)
