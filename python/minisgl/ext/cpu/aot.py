"""The decoder layer compiled ahead of time (AOTInductor), run by decode steps on CPU by
default on a quantized model (`--cpu-compile auto`): built once per model, dtype, quantization,
torch version, CPU and minisgl source (`torch.export` + `aoti_compile_and_package`: ~7 s on 2
cores for SmolLM2-135M, 2 MB), kept in the cache (beside a GGUF's conversion), loaded at later
starts in ~0.01 s. Two kinds: one request's step (`LayerStep`), and a batch's
(`BatchedLayerStep`: 2 to `MAX_BATCH` requests, an attention mask input; SmolLM2 Q4_1, 8
streams on 2 cores: 150-170 tok/s eager, 180-210 compiled). Prompts and any failure stay eager,
the failure said in one line.

One layer, not the whole step: the layers of a model are alike, so one artifact (one for each
distinct kind of layer: a GGUF may quantize layers differently) serves all of them, called
once a layer. The whole decoder as one graph decoded as fast (SmolLM2 on 2 cores: 83-90 tok/s
against 74-91 layer by layer, eager 46-51) but took 95 s to compile instead of 17.

The exported layer is a function of plain tensors: the position, hidden state and residual, the
request's new KV slot and KV slots, the RoPE table, the layer's K and V pools and its weights.
The weights are inputs, not constants, so the artifact holds no copy of the model (the group
sizes of the int4 layers, which inductor makes constants, are the only ones); the pools are
the per-layer views the engine holds (one KV buffer as a single input made export write each
layer's K and V through a copy of the whole buffer: 0.7 tok/s). The first layer, which has no
residual yet, gets zeros (x + 0 is x). The compiled layers give the same tokens as
`--enable-torch-compile` (the same inductor code); like it, not always eager's bits in
bfloat16. Their kernels read the thread count at each call: the thread governor
(`threads.py`) moves their steps between every core and one as it does eager ones."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from minisgl import env
from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from minisgl.context import Context, get_global_ctx, set_global_ctx
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.ext.cpu.gguf import (
    cache_root,
    conversion_size,
    prune_unused,
    remove_quietly,
    unused_for,
)
from minisgl.ext.cpu.native import cpu_flags, cpu_vendor, native_kernel
from minisgl.ext.cpu.options import cpu_options
from minisgl.ext.cpu.packed import pack_rule
from minisgl.ext.cpu.quantize import CpuModelTransform
from minisgl.kvcache.pool import MHAKVCache

FORMAT = 1  # bump when the exported step's inputs change
PREFIX = "decode-aot-"
# the dtypes of the step's index inputs as `run_step` makes them
INDEX_DTYPES = {"positions": torch.int64, "out_loc": torch.int64}
Run = Callable[[list[torch.Tensor]], list[torch.Tensor]]  # a compiled layer's entry point
# 16-bit values rounded where eager rounds them (a fused sum kept in float32 otherwise)
INDUCTOR = {"emulate_precision_casts": True}
RETRY_S = 86400  # a failed build is tried again after this long
TREESPEC_WARNING = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
MAX_LEN = 1 << 24  # the largest KV length and pool the exported step accepts
MAX_BATCH = 1024  # the most requests a batched step takes (more: eager)


def say(message: str) -> None:
    print(f"minisgl: {message}", file=sys.stderr)


def aot_decoder(engine: Any) -> nn.Module | None:
    """The decoder of decode steps with compiled layers for this `engine` (`engine.Engine`,
    after the speed paths): built at the first start, loaded at later ones; None (eager) where
    they do not apply (no line: cuda, TP > 1, MoE, another attention backend, --cpu-compile off,
    MINISGL_CPU_AOT=0) or where none can be built or loaded (one line saying why)."""
    kinds = aot_kinds(engine)
    if not kinds:
        return None
    try:
        steps = layer_steps(engine, LayerStep) if LayerStep in kinds else []
        batched = layer_steps(engine, BatchedLayerStep)
        paths = {id(step): artifact_path(engine, step) for step in steps + batched}
    except Exception as e:  # noqa: BLE001 (a model the step does not know: eager)
        say(f"eager decode: cannot compile this model's layers ({first_line(e)})")
        return None
    runs = compiled_layers(steps, paths) if steps else None
    if steps and runs is None:
        return None
    # None: batches eager (one line said why, or a batch never runs: its artifact stays cached)
    batched_runs = compiled_layers(batched, paths) if BatchedLayerStep in kinds else None
    prune(list(paths.values()))
    if runs is None and batched_runs is None:
        return None
    return AotDecoder(engine.model.model, runs, batched_runs, batched[0])


def compiled_layers(steps: list[LayerStep], paths: dict[int, str]) -> list[Run] | None:
    """The compiled layer of each of `steps` (each kind of layer built or loaded once), or
    None once one cannot be had."""
    runs: dict[int, Run] = {}
    for step in dict.fromkeys(steps):  # each kind of layer once, in order
        run = compiled_layer(step, paths[id(step)])
        if run is None:
            return None
        runs[id(step)] = run
    return [runs[id(step)] for step in steps]


def compiled_layer(step: LayerStep, path: str) -> Run | None:
    """The compiled layer at `path`, built first if absent; None after one line saying why."""
    failed = f"{path}.failed"
    # an earlier start could not build it: not every start again (tried again after a day)
    if os.path.isfile(failed) and unused_for(Path(failed)) < RETRY_S:
        why = Path(failed).read_text().strip()
        say(f"eager {step.steps}: building {path} failed earlier ({why})")
        return None
    if not os.path.isfile(path):
        try:
            build(step, path)
        except Exception as e:  # noqa: BLE001 (any failure of export or inductor: eager)
            why = first_line(e)
            say(f"eager {step.steps}: could not compile the decoder layer ({why})")
            write_quietly(failed, why)
            return None
    try:
        run = load(path)
    except Exception as e:  # noqa: BLE001 (a corrupt or foreign artifact: built again next time)
        say(f"eager {step.steps}: could not load {path} ({first_line(e)}); removed it")
        remove_quietly(path)
        return None
    try:
        os.utime(path)  # used: `prune` keeps it
    except OSError:  # a read-only cache
        pass
    return run


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0] if text else ''}"[:300]


def aot_kinds(engine: Any) -> tuple[type[LayerStep], ...]:
    """The kinds of decode step whose layers run compiled: both under --cpu-compile aot, or
    auto on a quantized model; auto on a dense one (`--quantization none`, the exact path in
    float32) only batches where one request's eager step is transformers' F.linear bit for bit
    (Intel: `packed.rule_for`), both where it is not (oneDNN's sums at one row already).
    None under MINISGL_CPU_AOT=0 (e.g. tests that build many engines), off a cpu engine whose
    layers one graph can hold (--enable-torch-compile's checks) with the speed paths' RoPE
    table (`speed.TableRotary`), and where another extension wrapped the model's transform
    (LoRA's layers read each step's adapter slots, which an exported graph would hold fixed)."""
    mode, moe = cpu_options(engine.config).cpu_compile, engine.model_config.moe is not None
    applies = (
        mode != "off"
        and ("MINISGL_CPU_AOT" not in os.environ or env.flag("MINISGL_CPU_AOT"))
        and engine.device.type == "cpu"
        and get_tp_info().size == 1
        and not moe
        and isinstance(engine.attn_backend, TorchAttnBackend)
        and isinstance(getattr(engine.model.model.rotary, "tables", None), dict)
        and isinstance(engine.model_transform, CpuModelTransform)
    )
    if not applies:
        return ()
    # one request at a time (the shell's default) never runs a batch: none built
    batched = (BatchedLayerStep,) if engine.config.max_running_requests > 1 else ()
    if mode == "aot" or engine.quantization != "none" or pack_rule().takes(1, decode=True):
        return (LayerStep, *batched)
    return batched


class TracedPools(MHAKVCache):
    """The KV pools as the exported step sees them: its inputs, one per layer and K / V."""

    def __init__(self, like: MHAKVCache, k_pools: list[torch.Tensor], v_pools: list[torch.Tensor]):
        self.num_layers, self.page_size = like.num_layers, like.page_size
        self.num_kv_heads, self.head_dim, self.dtype = like.num_kv_heads, like.head_dim, like.dtype
        self.device, self._k_flat, self._v_flat = like.device, k_pools, v_pools


class LayerStep(nn.Module):
    """One decoder layer on one request's decode step as a function of plain tensors (the
    module `torch.export` traces): the layer reads its batch and KV pools from the global
    context, so the trace sets a context of its inputs around the call."""

    steps = "decode"  # what runs eagerly when this kind cannot be had (its one line says)

    def __init__(self, engine: Any, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.dtype: torch.dtype = engine.dtype
        self.kv_cache: MHAKVCache = engine.kv_cache
        self.attn_backend = engine.attn_backend
        self.page_size: int = engine.page_size
        self.hidden_size: int = engine.model_config.hidden_size
        self.weight_names = [name for name, _ in named_weights(layer)]
        rotary = engine.model.model.rotary  # speed.TableRotary (not imported: speed imports this)
        self.rotary = [rotary]  # held, not registered: the table is an input
        self.rope_table: torch.Tensor = rotary.tables[self.dtype]

    def forward(
        self, positions: Tensor, hidden: Tensor, residual: Tensor, out_loc: Tensor,
        kv_slots: Tensor, rope_table: Tensor, k_pool: Tensor, v_pool: Tensor, weights: list[Tensor],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """The exported inputs of one request's step (no mask: every slot)."""
        inputs = (positions, hidden, residual, out_loc, kv_slots, None, rope_table, k_pool, v_pool)
        return self.run(*inputs, weights)

    def run(
        self, positions: Tensor, hidden: Tensor, residual: Tensor, out_loc: Tensor,
        kv_slots: Tensor, mask: Tensor | None, rope_table: Tensor, k_pool: Tensor, v_pool: Tensor,
        weights: list[Tensor],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        """The layer on these inputs, attending under `mask` (None: every slot)."""
        md = TorchAttnMetadata(kv_slots, mask, kv_slots.new_zeros(1), 1)
        batch = Batch([], "decode", out_loc=out_loc, attn_metadata=md)
        layers = self.kv_cache.num_layers  # whatever its layer id, the layer reads these pools
        pools = TracedPools(self.kv_cache, [k_pool] * layers, [v_pool] * layers)
        unused_page_table = kv_slots  # the step's slots come in whole
        ctx = Context(self.page_size, unused_page_table, pools, self.attn_backend, batch)
        rotary, saved_tables = self.rotary[0], self.rotary[0].tables
        rotary.tables = {self.dtype: rope_table}
        set_global_ctx(ctx)
        try:
            state = dict(zip(self.weight_names, weights, strict=True))
            args = (positions, hidden, residual)
            return torch.func.functional_call(self.layer, state, args, tie_weights=False)
        finally:
            rotary.tables = saved_tables

    def example(self) -> tuple[Any, ...]:
        """Example inputs at KV length 3 (the length and the pools' slots are dynamic)."""
        inputs = self.example_of(1)
        return inputs[:5] + inputs[6:]  # without the mask

    def example_of(self, rows: int) -> tuple[Any, ...]:
        """`rows` requests' inputs at KV length 3, with a mask (the batched step's order)."""
        pos = torch.full((rows,), 2, dtype=INDEX_DTYPES["positions"])
        hidden = torch.zeros(rows, self.hidden_size, dtype=self.dtype)
        out_loc = torch.arange(rows, dtype=INDEX_DTYPES["out_loc"]) * 3 + 2
        kv_slots = torch.arange(rows * 3).view(rows, 3)
        mask = torch.ones(rows, 1, 1, 3, dtype=torch.bool)
        pools = self.kv_cache
        weights = [w for _, w in named_weights(self.layer)]
        args = (pos, hidden, hidden.clone(), out_loc, kv_slots, mask, self.rope_table)
        return (*args, pools.k_flat(0), pools.v_flat(0), weights)

    def dynamic_shapes(self) -> tuple[Any, ...]:
        """`example`'s dynamic dimensions: the KV length and the pools' slots."""
        length, slots = torch.export.Dim("kv_len", min=2, max=MAX_LEN), torch.export.Dim("slots")
        weights = [None] * len(self.weight_names)
        return (None, None, None, None, {1: length}, None, {0: slots}, {0: slots}, weights)

    def signature(self) -> list[Any]:
        """What the compiled layer depends on besides torch, the CPU, minisgl's source and the
        model's config: its modules' kinds, its weights' shapes, the pools', the backend."""
        modules = [(name, type(m).__name__) for name, m in self.layer.named_modules()]
        weights = [(n, list(w.shape), str(w.dtype)) for n, w in named_weights(self.layer)]
        pools = self.kv_cache
        pool_shape = [pools.num_kv_heads, pools.head_dim, str(pools.dtype)]
        backend = type(self.attn_backend).__name__
        return [type(self).__name__, backend, str(self.dtype), pool_shape, modules, weights]


class BatchedLayerStep(LayerStep):
    """`LayerStep` on a decode step of 2 to `MAX_BATCH` requests: their KV slots padded to the
    longest and a mask [B, 1, 1, L] saying which each attends (the torch backend's)."""

    steps = "batched decode"

    # the exported inputs of a batch's step: `run`'s, the mask given
    forward = LayerStep.run  # type: ignore[assignment]

    def example(self) -> tuple[Any, ...]:
        return self.example_of(3)  # not 2: export specializes sizes 0 and 1 only, but be clear

    def dynamic_shapes(self) -> tuple[Any, ...]:
        """The request count too."""
        rows = torch.export.Dim("rows", min=2, max=MAX_BATCH)
        length, slots = torch.export.Dim("kv_len", min=2, max=MAX_LEN), torch.export.Dim("slots")
        weights = [None] * len(self.weight_names)
        per_row = ({0: rows},) * 4
        return (*per_row, {0: rows, 1: length}, {0: rows, 3: length}, None,
                {0: slots}, {0: slots}, weights)  # fmt: skip


def named_weights(layer: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(layer.named_parameters()) + list(layer.named_buffers())


def layer_steps(engine: Any, kind: type[LayerStep] = LayerStep) -> list[LayerStep]:
    """The step (of `kind`) of each decoder layer: one object for the layers of one
    signature."""
    by_signature: dict[str, LayerStep] = {}
    steps = []
    for layer in engine.model.model.layers:
        step = kind(engine, layer)
        steps.append(by_signature.setdefault(json.dumps(step.signature()), step))
    return steps


def artifact_path(engine: Any, step: LayerStep) -> str:
    """`decode-aot-<key>.pt2` beside the model's GGUF conversion, else in the cache's `aot/`
    (a directory per checkpoint), keyed by everything the compiled layer depends on."""
    key = json.dumps(
        [FORMAT, torch.__version__, sorted(cpu_flags()), source_digest(), engine.quantization,
         repr(engine.model_config), step.signature(), cpu_vendor()],  # vendor: packed.rule_for
        default=str,
    )  # fmt: skip
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    model_dir = engine.model_path
    if conversion_size(model_dir) is None:
        checkpoint = hashlib.sha256(os.path.abspath(model_dir).encode()).hexdigest()[:16]
        model_dir = os.path.join(cache_root(), "aot", checkpoint)
    return os.path.join(model_dir, f"{PREFIX}{digest}.pt2")


@functools.cache  # asked for each layer's artifact of each kind: 60 reads of ~190 files, 0.27 s
def source_digest() -> str:
    """minisgl's Python source (the traced code runs through the core's layers): a change
    compiles again (at the next start: read once a process)."""
    root = Path(__file__).resolve().parents[2]
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def build(step: LayerStep, path: str) -> None:
    """Exports and compiles the layer into `path` (written whole or not at all)."""
    from torch._inductor import aoti_compile_and_package

    say(f"compiling the decoder layer for {step.steps} steps once (~7 s on 2 cores) into {path}")
    start = time.perf_counter()
    dynamic = step.dynamic_shapes()
    saved_ctx = get_or_none()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}.pt2"  # the packager wants the suffix
    with warnings.catch_warnings():
        # torch 2.13's own deprecation inside export (nothing a user can act on; it printed two
        # lines of its internals in the middle of a first start)
        warnings.filterwarnings("ignore", TREESPEC_WARNING, FutureWarning)
        try:
            with torch.no_grad():
                example = step.example()
                program = torch.export.export(step, example, dynamic_shapes=dynamic, strict=False)
        finally:
            set_global_ctx(saved_ctx)
        try:
            aoti_compile_and_package(program, package_path=tmp, inductor_configs=inductor_configs())
            os.replace(tmp, path)
        finally:
            remove_quietly(tmp)
    size = os.path.getsize(path) / 1e6
    say(f"compiled the decoder layer in {time.perf_counter() - start:.0f} s ({size:.0f} MB)")


def inductor_configs() -> dict[str, Any]:
    """INDUCTOR, and two costs of a first build left out (AMD VM, 2 cores, the shell's first
    start: 30.8 s with both, 19-20 s without):
    - no precompiled header: inductor makes one of torch's headers at a first build (~8 s,
      283 MB in /tmp, which a reboot often empties), worth ~2 s a later build; minisgl builds
      once per model and version;
    - once the native kernels have loaded (the same compiler built them for this CPU), no dry
      compile of inductor's vector headers for each ISA the CPU lists (3.8 s; torch still
      checks what an ISA adds: avx512_bf16, VNNI, AMX)."""
    configs = {**INDUCTOR, "aot_inductor.precompile_headers": False}
    if native_kernel() is not None:
        configs["cpp.vec_isa_ok"] = True
    return configs


def prune(paths: list[str]) -> None:
    """Removes the artifacts (and failure notes) beside `paths` of other keys unused for a
    week (`gguf.prune_unused`; a load touches its file)."""
    keep = {os.path.basename(p) for p in paths}
    for folder in {os.path.dirname(p) for p in paths}:
        prune_unused(folder, f"{PREFIX}*", keep)


def get_or_none() -> Context | None:
    try:
        return get_global_ctx()
    except RuntimeError:
        return None


def load(path: str) -> Run:
    """The compiled step's entry point (torch's C++ package loader: `aoti_load_package` would
    import inductor, ~2 s, for nothing)."""
    loader = torch._C._aoti.AOTIModelPackageLoader(path, "model", False, 1, -1)
    return loader.run  # type: ignore[no-any-return]


class AotDecoder(nn.Module):
    """`Engine.decoder(batch)` of decode steps: the decoder with its layers run compiled
    (`runs`, one a layer, for one request; `batched_runs` for several; None: those eager), or
    eager for a step they do not hold (one request's masked step: a sliding window shorter than
    its KV)."""

    # nothing compiles at its first call: a server need not warm it up (ext/serving's needs_warm_up)
    needs_warm_up = False

    def __init__(
        self,
        decoder: Any,
        runs: list[Run] | None,
        batched_runs: list[Run] | None,
        step: LayerStep,
    ) -> None:
        super().__init__()
        self.decoder = decoder
        self.runs = runs
        self.batched_runs = batched_runs
        self.kv_cache = step.kv_cache
        self.rope_table = step.rope_table
        self.weights = [[w for _, w in named_weights(layer)] for layer in decoder.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        batch = get_global_ctx().batch
        assert batch is not None
        md = TorchAttnMetadata.of(batch)
        out_loc = batch.out_loc
        if out_loc is None or (runs := self.runs_for(positions, out_loc, md)) is None:
            return self.decoder(input_ids, positions)  # type: ignore[no-any-return]
        hidden = self.decoder.embed_tokens(input_ids)
        residual = torch.zeros_like(hidden)
        pools, table, kv_slots = self.kv_cache, self.rope_table, md.kv_slots
        mask = []  # a batch's: the backend's, or every slot's
        if runs is self.batched_runs:
            rows, length = kv_slots.shape
            mask = [
                torch.ones(rows, 1, 1, length, dtype=torch.bool) if md.mask is None else md.mask
            ]
        for i, run in enumerate(runs):
            k, v = pools.k_flat(i), pools.v_flat(i)
            inputs = [positions, hidden, residual, out_loc, kv_slots, *mask, table, k, v]
            hidden, residual = run(inputs + self.weights[i])
        return self.decoder.norm(hidden, residual)[0]  # type: ignore[no-any-return]

    def runs_for(
        self, positions: torch.Tensor, out_loc: torch.Tensor, md: TorchAttnMetadata
    ) -> list[Run] | None:
        """The compiled layers that hold this step, None if neither does: one token a request,
        the index dtypes the layers were exported with (the compiled code reads them as such),
        one request unmasked or 2 to `MAX_BATCH` with the batched layers."""
        rows = md.kv_slots.shape[0]
        fits = (
            md.max_q_len == 1 and positions.shape == (rows,) and out_loc.shape == (rows,)
            and positions.dtype == INDEX_DTYPES["positions"]
            and out_loc.dtype == INDEX_DTYPES["out_loc"] and md.kv_slots.dtype == torch.int64
        )  # fmt: skip
        if not fits:
            return None
        if rows == 1:
            return self.runs if md.mask is None else None
        return self.batched_runs if rows <= MAX_BATCH else None


def write_quietly(path: str, text: str) -> None:
    try:
        Path(path).write_text(text + "\n")
    except OSError:
        pass
