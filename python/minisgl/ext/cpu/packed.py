"""Float32 projections through oneDNN's GEMM on a weight packed once, where MKL is slower.

F.linear's float32 kernel on x86 is MKL's sgemm (transformers' too); oneDNN's matmul on the
weight reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, as
vLLM's CPU backend does) is the alternative. Which wins depends on the CPU (`rule_for`):
- Intel (a 2-core AVX512 VM): MKL packs the weight again at every call of 3 rows or
  more (SmolLM2-135M's 121 projections: 52-67 ms a step at 8 rows against 29 at one); the
  packed weight takes 37-39 ms at 4 to 8 rows, 1.1-1.3x faster up to 256, while MKL is the
  faster at 1 to 3 rows and runs prompts near peak. Decode steps of 4..256 rows take oneDNN.
- any other vendor naming itself in /proc/cpuinfo (measured: AMD EPYC Zen 5 VM, 2 cores):
  MKL runs a slow path at every row count. One row through 30 layers' weights from memory (a
  step's case): oneDNN 2.2-2.9x faster (1.7-2.1x on one thread), 3.5-5.2x at 2-3 rows (with
  the weights in cache one row ties: 0.96-1.8x, 0.68-1.08x on one thread); 1,000 rows
  2.3-2.4x (212 against 505 GFLOP/s); the LM head 2.2-13x at 1-256 rows. Every row takes
  oneDNN, prompts too: one stream 27 -> 68 tok/s, a 1,000-token prompt 1.2 -> 0.6 s.
A CPU naming no vendor (not x86, where MKL is not torch's kernel) keeps Intel's rule.

The sums round otherwise than F.linear's: logits differ from transformers' by float32
rounding (the tests' 1e-4), greedy tokens are the same (tests check both), not bit for bit.
A compiled decode step (`--cpu-compile`, `--enable-torch-compile`) calls back
`torch.ops.minisgl.packed_linear`, which applies the same rule when it runs (a batch's row
count is not known before). The packed copy is made at a projection's first such call and kept
on the weight (SmolLM2: +540 MB; the dense one stays, for the rule's other rows, the compiled
steps' inputs and a tied embedding). A long prompt's gate/up product (`gated_silu`) runs as two
GEMMs on packed halves (another copy of gate/up: SmolLM2 +212 MB) with the SiLU and the
product in their epilogues. Measured beside vLLM-CPU: benchmarks.md."""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.context import get_global_ctx
from minisgl.ext.cpu.native import cpu_vendor
from minisgl.ext.cpu.routes import projections, route_through

PACK_ROWS_HINT = 8  # the batch size oneDNN picks its layout for (1 to 1,000 measured the same)
PACKED_ATTR = "onednn_packed"
INTEL = "GenuineIntel"


@dataclass(frozen=True)
class PackRule:
    """Which float32 projections compute on the packed weight: `min_rows..max_rows` rows of a
    decode step, and of a prompt too where `prompts`."""

    min_rows: int
    max_rows: int
    prompts: bool

    def takes(self, rows: int, decode: bool) -> bool:
        return self.min_rows <= rows <= self.max_rows and (decode or self.prompts)


# measured on an Intel VM, where MKL wins at 1-3 rows and runs prompts near peak
DECODE_BATCHES = PackRule(4, 256, prompts=False)
# measured on an AMD EPYC (Zen 5) VM, where MKL is 1.7-13x slower at every row count (weights
# from memory, as in a step)
EVERY_ROW = PackRule(1, sys.maxsize, prompts=True)


def rule_for(vendor: str) -> PackRule:
    """Every row on oneDNN where the CPU names a vendor other than Intel (MKL's sgemm runs a
    slow path there); Intel's, and a CPU naming none (not x86: MKL is not torch's kernel),
    keep oneDNN for decode batches, where it was measured to win."""
    return EVERY_ROW if vendor and vendor != INTEL else DECODE_BATCHES


@functools.cache
def pack_rule() -> PackRule:
    return rule_for(cpu_vendor())


def packs_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def packed_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's copy of `weight`, made at its first need and kept on the weight itself (a
    compiled step's inputs are the same tensor objects)."""
    packed = getattr(weight, PACKED_ATTR, None)
    if packed is None:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
        setattr(weight, PACKED_ATTR, packed)
    return packed


def onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), b, "none", [], "")


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b of a decode step on the packed weight where the rule takes its rows, else
    F.linear: an eager step's, and a compiled step's through `torch.ops.minisgl.packed_linear`,
    which it calls back (a batch's row count is known only when it runs)."""
    if pack_rule().takes(x.shape[0], decode=True):
        return onednn_linear(x, w, b)
    return F.linear(x, w, b)


def packed_linear_shape(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


# a plain CPU kernel (torch.library.custom_op's wrapper costs 20 us a call, this 5)
_LIBRARY = torch.library.Library("minisgl", "FRAGMENT")
_LIBRARY.define("packed_linear(Tensor x, Tensor w, Tensor? b) -> Tensor")
_LIBRARY.impl("packed_linear", packed_linear, "CPU")
torch.library.register_fake("minisgl::packed_linear", packed_linear_shape, lib=_LIBRARY)


class PackedFloatLinear:
    """x W^T (+ bias) of one float32 projection: `matmul` for the layer's partial sum, `forward`
    with its bias (`routes.route_through`). The weight and bias are read from the module at each
    call: a compiled layer's export hands them in as inputs there."""

    def __init__(self, module: nn.Module) -> None:
        self.module: Any = module  # a LinearBase or the LM head
        self.rule = pack_rule()  # read here: torch.compile cannot trace reading /proc/cpuinfo

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, getattr(self.module, "bias", None))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.module.weight
        if x.dim() != 2 or x.dtype != torch.float32:
            return F.linear(x, weight, bias)
        rows = x.shape[0]
        if torch.compiler.is_compiling():
            # a compiled decode step: a dynamic row count (a SymInt: a batch's) is left to the
            # op at run time, as comparing it here would constrain the exported shape
            if type(rows) is not int or self.rule.takes(rows, decode=True):
                return torch.ops.minisgl.packed_linear(x, weight, bias)
            return F.linear(x, weight, bias)
        batch = get_global_ctx().batch
        if batch is None or not self.rule.takes(rows, batch.is_decode):
            return F.linear(x, weight, bias)
        return onednn_linear(x, weight, bias)


# a merged gate/up product of this many bytes goes to memory between the GEMM and the SiLU pass
# (2 AVX512 cores of an AMD VM, SmolLM2 prompts: 256 rows, 3 MB, 1.6 % slower in two GEMMs; 512
# rows tie; 1,000 rows, 12 MB, 4.4 % faster end to end; 2,000 rows 5.5 %)
GATED_MIN_BYTES = 8 << 20
GATED_ATTR = "onednn_gated"
ROUTE_ATTR = "onednn_route"


def packed_halves(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """oneDNN's copies of a merged [gate; up] weight's halves, made at their first need."""
    halves = getattr(weight, GATED_ATTR, None)
    if halves is None:
        inter = weight.shape[0] // 2
        gate, up = (w.contiguous() for w in (weight[:inter], weight[inter:]))
        halves = tuple(
            torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS_HINT) for w in (gate, up)
        )
        setattr(weight, GATED_ATTR, halves)
    return halves


def gated_silu(gate_up: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """silu(x Wg^T) * (x Wu^T) of a merged gate/up projection routed here, in two GEMMs on its
    packed halves with the SiLU and the product in their epilogues: the [rows, 2 x inter]
    product never makes a pass through memory. For an eager step's [rows, in] float32 input
    whose rows the rule takes and whose product is at least GATED_MIN_BYTES (a long prompt),
    while the projection's route is still ours; None elsewhere (the caller then multiplies and
    applies SiLU-and-mul)."""
    route: PackedFloatLinear | None = getattr(gate_up, ROUTE_ATTR, None)
    if route is None or x.dim() != 2:
        return None
    rows, weight = x.shape[0], route.module.weight  # the size first: decode steps leave here
    if rows * weight.shape[0] * weight.element_size() < GATED_MIN_BYTES or gate_up.bias is not None:
        return None
    batch = get_global_ctx().batch
    if batch is None or not route.rule.takes(rows, batch.is_decode):
        return None
    if gate_up.forward != route.forward:  # another layer wrapped the projection since
        return None
    gate, up = packed_halves(weight)
    activated = torch.ops.mkldnn._linear_pointwise(x, gate, None, "swish", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, activated, up, None, "mul")


def pack_float_projections(model: nn.Module) -> None:
    """Route every float32 projection of `model` (a cpu engine's, unquantized) through a
    `PackedFloatLinear`; none where oneDNN's ops are missing from the torch build."""
    if not packs_available():
        return
    for _, module in projections(model):
        weight = module.weight
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.numel():
            layer = PackedFloatLinear(module)
            route_through(module, layer.matmul, layer.forward)
            setattr(module, ROUTE_ATTR, layer)  # read by `gated_silu`
