"""The LoRA computation of a projection and the model transform that installs it.

For each token t with slot s = slots[t] (0: no adapter, unchanged):
    y[t] = base(x)[t] + (x[t] A_s^T) B_s^T        (scaling folded into B, `weights.py`)
a merged projection (qkv: three parts, gate_up: two) in one call, part j's output rows reading
rank block j of x A_s^T. `lora_reference` is the torch reference (float32 math; the CPU path);
`add_lora` is the entry point the Triton kernel (`kernel.py`) replaces on CUDA.

The contract with the core:
- the engine builds its model through `LoraModelTransform` (a `ModelTransform`: the
  `model_transform` point), which wraps the transform it would otherwise use (`inner`, e.g. the
  cpu extension's) and installs the LoRA path on every dense projection after the weights load;
- each request's adapter slot is kept by page-table row in `row_slots` ([max_running_requests +
  1] int32 on the model's device, allocated once; 0: no adapter, as the dummy row that padded
  graph rows use), written when a request is given a row (`set_row`, the step feature's
  `admitted`: a device write queued behind the steps in flight, as the page table's are);
- during a forward each token's slot is `row_slots[batch.rows]` (`Batch.rows`: the page-table
  row of each token, which the step computes from its inputs): gathered on the device once per
  forward, inside the step, so a CUDA-graph replay, a speed path's rows or an overlapped step
  read the slots as they read the page table, with no per-step host work;
- the prefix cache keys a request's KV by its adapter (the step feature's `cache_namespace`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from minisgl import kernel
from minisgl.context import get_global_ctx
from minisgl.ext.lora.weights import LoraStack, ProjectionLora
from minisgl.extension import ModelTransform
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.linear import RowParallelLinear
from minisgl.models.llama import MLP

KERNEL = "minisgl.ext.lora.kernel"
# The joint GEMV reads every slot's A (r_max rows a part) beside W. It saves the shrink's
# launch, about 3 us (Qwen3-8B, one H200: LoRA cost 0.96 ms a token in 324 small launches),
# and pays for the extra bytes: up to 4 MiB (about 1 us at 4.3 TB/s) it wins. The 8B at rank
# 16 and one slot (1.6 % more rows on qkv): 199 -> 227 tok/s; rank 64 and one slot: 3 MiB.
JOINT_MAX_BYTES = 4 << 20


def lora_reference(
    y: torch.Tensor, x: torch.Tensor, slots: torch.Tensor, proj: ProjectionLora
) -> torch.Tensor:
    """y [T, out] + each token's LoRA delta, x [T, in], slots [T]; float32 math. Every slot is
    computed over all rows and kept where it is the token's (no host sync: CUDA-graph safe);
    on the CPU only the slots present are computed."""
    delta = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
    xf, rank, bounds = x.float(), proj.rank, proj.bounds
    present = range(1, proj.a.shape[0]) if slots.is_cuda else sorted(set(slots.tolist()) - {0})
    for s in present:
        inter = xf @ proj.a[s].float().T  # [T, parts * rank]
        parts = [
            inter[:, j * rank : (j + 1) * rank] @ proj.b[s, lo:hi].float().T
            for j, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
        ]
        delta += torch.where((slots == s)[:, None], torch.cat(parts, dim=1), 0.0)
    return y + delta.to(y.dtype)


def add_lora(
    base: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    slots: torch.Tensor,
    proj: ProjectionLora,
    silu: bool = False,
) -> torch.Tensor:
    """base(x) + the LoRA delta of each token's slot (`silu`: then SiLU(gate) * up, for
    gate_up). On CUDA: a decode step's few rows (the GEMV's) take one GEMV over the joint
    [A; W] and one launch after it (`kernel.lora_expand_joint`); larger batches take the
    Triton shrink before base (its GEMM then reads its first weights while the shrink runs,
    PDL) and the expand in place. Elsewhere the torch reference."""
    if x.shape[0] != slots.shape[0]:
        raise ValueError(f"LoRA: {x.shape[0]} tokens but {slots.shape[0]} slot indices")
    if (ops := kernel.fused_ops(x, KERNEL)) is None:
        y = lora_reference(base(x), x, slots, proj)
    elif proj.joint is not None and (gemv := kernel.gemv_ops(x, proj.joint)) is not None:
        rows, k = proj.module.weight.shape  # the base weight's tuned tiles
        config = gemv.config_for(rows, k, x.shape[0], x.device, False)
        out = gemv.gemv(x, proj.joint, None, config)
        return ops.lora_expand_joint(out, slots, proj.b, proj.offsets, proj.bounds, silu)
    else:
        inter = ops.lora_shrink(x, slots, proj.a)
        y = base(x)
        if inter is not None:
            y = ops.lora_expand(y, inter, slots, proj.b, proj.offsets, proj.bounds)
    return silu_and_mul(y) if silu else y


class LoraModelTransform:
    """A `ModelTransform` that gives every dense projection of the model (q/k/v, o, gate/up,
    down of its decoder layers) `max_loras` adapter slots of rank up to `max_rank`, each token
    reading its slot by its page-table row (see the module docstring)."""

    def __init__(
        self,
        max_loras: int,
        max_rank: int,
        rows: int,
        device: torch.device,
        inner: ModelTransform | None = None,
    ) -> None:
        self.name = inner.name if inner is not None else "none"  # Engine.quantization
        self.inner = inner
        self.max_loras, self.max_rank = max_loras, max_rank
        self.row_slots = torch.zeros(rows, dtype=torch.int32, device=device)
        self.stack: LoraStack | None = None
        self._rows: torch.Tensor | None = None  # the forward's Batch.rows, and its slots
        self._slots: torch.Tensor | None = None

    def before_load(self, model: nn.Module) -> set[str]:
        return self.inner.before_load(model) if self.inner is not None else set()

    def after_load(self, model: nn.Module) -> None:
        if self.inner is not None:
            self.inner.after_load(model)
        self.stack = LoraStack(model, self.max_loras, self.max_rank)
        install(model, self.stack, self.slots)

    def set_row(self, row: int, slot: int) -> None:
        """The request given page-table row `row` runs on adapter slot `slot` (0: none)."""
        self.row_slots[row] = slot

    def slots(self, num_tokens: int) -> torch.Tensor:
        """The slots of the forward's `num_tokens` tokens (gathered once per forward: the
        step's `rows` tensor is new each time, a graph capture's too)."""
        batch = get_global_ctx().batch
        rows = batch.rows if batch is not None else None
        if rows is None or rows.shape[0] != num_tokens:
            raise RuntimeError("LoRA: a forward outside the engine's step (no Batch.rows)")
        if rows is not self._rows:
            self._rows, self._slots = rows, self.row_slots[rows]
        assert self._slots is not None
        return self._slots


def install(model: nn.Module, stack: LoraStack, slots: Callable[[int], torch.Tensor]) -> None:
    """Route every projection of `stack` through `add_lora`. The layers compute with their own
    methods, so instance attributes (which win over the class's) wrap what computes x W^T now
    (the class's method, or a transform's that came before): `forward` of column-parallel
    layers (bias included), `matmul` of row-parallel ones (the partial sum, before the
    all-reduce, so the A shards' partial deltas add up with it)."""
    bases: dict[nn.Module, Callable[[torch.Tensor], torch.Tensor]] = {}
    for proj in stack.projections.values():
        module = proj.module
        attr = "matmul" if isinstance(module, RowParallelLinear) else "forward"
        bases[module] = base = getattr(module, attr)
        if not _joint_pays(proj, attr):
            proj.joint = None
        setattr(module, attr, _with_lora(base, proj, slots))
    by_module = {proj.module: proj for proj in stack.projections.values()}
    for mlp in model.modules():
        # the dense MLPs whose gate_up has a LoRA (not MoE layers, nor their shared experts)
        if isinstance(mlp, MLP) and (gate_up := by_module.get(mlp.gate_up_proj)) is not None:
            gate_up_act = _with_lora(bases[gate_up.module], gate_up, slots, silu=True)
            mlp.forward = _lora_mlp(mlp, gate_up_act)  # type: ignore[method-assign,assignment]


def _joint_pays(proj: ProjectionLora, attr: str) -> bool:
    """Whether the joint GEMV computes what the layer's `attr` does (the class's own x W^T,
    without a column-parallel layer's bias; not a method a transform installed before) and
    its extra reads stay under JOINT_MAX_BYTES (many slots or a large max rank: the shrink)."""
    module = proj.module
    if (attr == "forward" and module.bias is not None) or attr in vars(module):
        return False
    return proj.a.numel() * proj.a.element_size() <= JOINT_MAX_BYTES


def _with_lora(
    base: Callable[[torch.Tensor], torch.Tensor],
    proj: ProjectionLora,
    slots: Callable[[int], torch.Tensor],
    silu: bool = False,
) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        return add_lora(base, x, slots(x.shape[0]), proj, silu)

    return forward


def _lora_mlp(
    mlp: MLP, gate_up_act: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The MLP with SiLU-and-mul after gate_up's LoRA (`gate_up_act`): the core's decode GEMV
    computes it in its epilogue, which would skip the LoRA of gate/up."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return mlp.down_proj(gate_up_act(x))

    return forward
