"""Float32 projections of decode batches through oneDNN's GEMM on a weight packed once.

MKL's sgemm (F.linear's float32 kernel on x86) packs the weight again at every call of 3 rows or
more: on 2 AVX512 cores SmolLM2-135M's 121 projections take 52-67 ms a step at 8 rows against
29 at one, and 140 at 8 rows on one thread. oneDNN's matmul on the weight reordered once into
its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`; vLLM's CPU backend does the same
for its linears) takes 37-39 ms at 4 to 8 rows (64 on one thread), 1.1-1.3x faster up to 256
rows; at 1 to 3 rows MKL's kernel is the faster one.

Only decode steps of PACKED_MIN_ROWS..PACKED_MAX_ROWS rows take it. One request's decode and a
prompt keep F.linear: bit for bit what transformers computes for one sequence. A batch's rows
already differ from one request's by float32 rounding under F.linear (MKL sums 8 rows in another
order than its one-row kernel), and do so here too. A compiled batched step (`--cpu-compile
aot`) calls back `torch.ops.minisgl.packed_linear`, which decides by the rows when it runs;
one request's compiled step traces F.linear. The packed copy is made at a layer's first such
step and kept on the weight (SmolLM2: +540 MB). Measured beside vLLM-CPU: benchmarks.md."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.context import get_global_ctx
from minisgl.ext.cpu.routes import projections, route_through

PACKED_MIN_ROWS = 4
PACKED_MAX_ROWS = 256
PACK_ROWS_HINT = 8  # the batch size oneDNN picks its layout for (64 measured the same)
PACKED_ATTR = "onednn_packed"


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


def rows_pay(rows: int) -> bool:
    return PACKED_MIN_ROWS <= rows <= PACKED_MAX_ROWS


def packed_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x W^T + b on the packed weight where the rows pay for it, else F.linear: an eager decode
    step's, and a compiled batched step's (its row count known only when it runs) through
    `torch.ops.minisgl.packed_linear`, which the compiled step calls back."""
    if rows_pay(x.shape[0]):
        return torch.ops.mkldnn._linear_pointwise(x, packed_weight(w), b, "none", [], "")
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

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, getattr(self.module, "bias", None))

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        weight = self.module.weight
        if torch.compiler.is_compiling():
            # a dynamic row count (a SymInt: a batched step's) is left to the op at run time;
            # comparing it here would constrain the exported shape
            if x.dim() == 2 and type(x.shape[0]) is not int and x.dtype == torch.float32:
                return torch.ops.minisgl.packed_linear(x, weight, bias)
            return F.linear(x, weight, bias)
        if not self.takes(x):
            return F.linear(x, weight, bias)
        return packed_linear(x, weight, bias)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """An eager decode step's [rows, in] float32 input whose rows pay for the pack."""
        if x.dim() != 2 or not rows_pay(x.shape[0]) or x.dtype != torch.float32:
            return False
        batch = get_global_ctx().batch
        return batch is not None and batch.is_decode


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
