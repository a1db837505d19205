"""Adapters resident on the device: stacked LoRA weights in slots, and the slots' manager.

`LoraStack` holds, per decoder layer and minisgl projection (qkv_proj, o_proj, gate_up_proj,
down_proj), `ProjectionLora`: A as [slots, parts * r_max, in] and B as [slots, out, r_max]
(this rank's shard), zero-padded to r_max, scaling folded into B. A's rows and the layer's
weight share one matrix, `joint` = [A of every slot; W] (the weight becomes a view of its
last rows), so that one GEMV computes a decode step's base output and every slot's x A^T. A
merged projection's parts (q/k/v, gate/up) stack their A along the rank dimension and their B
along the output rows, so part j's output rows read rank block j: one kernel call covers the
merged layer. Slot 0 is "no adapter": its weights stay zero and the kernel skips its tokens. A
part an adapter does not adapt stays zero too.

Sharding follows the layer each projection wraps, through the layer's own weight loaders:
column-parallel (qkv, gate_up) split B by output rows at the offsets the layer's checkpoint
loader uses (A whole); row-parallel (o, down) split A by input columns (B whole), so each rank's
delta is a partial sum that the layer's all-reduce adds up with its base output.

`SlotManager` hands the slots out like KV pages: an adapter is loaded (from the host cache, or
from disk into it) into a free slot, or into the slot of the least recently used idle adapter,
which goes back to the host cache; an adapter in use (pinned by a running request) is never
evicted; the host cache keeps at most `max_cpu_loras` adapters, dropping the least recently
used one that is not on the device."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import nn

from minisgl.ext.lora.adapter import MODULES, LoraAdapter, LoraWeights
from minisgl.layers.linear import LinearBase, MergedColumnParallelLinear, RowParallelLinear

T = TypeVar("T")
_PROJECTION = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)")


class SlotsBusy(RuntimeError):
    """Every device slot holds an adapter in use: the request must wait for one to finish."""


class AdapterInUse(RuntimeError):
    """An adapter that running requests use cannot be removed."""


class SlotManager(Generic[T]):
    """Which adapter (by name) is in which device slot (1..max_loras; 0 is "no adapter"), the
    host cache, and the pins of adapters in use. `load(name)` reads an adapter from disk (its
    errors propagate, nothing changed); `write(slot, adapter)` puts one on the device."""

    def __init__(
        self,
        max_loras: int,
        max_cpu_loras: int,
        load: Callable[[str], T],
        write: Callable[[int, T], None],
    ) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {max_loras}")
        if max_cpu_loras < max_loras:
            raise ValueError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras})")
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self._load, self._write = load, write
        self.device: OrderedDict[str, int] = OrderedDict()  # name -> slot, least recent first
        self.host: OrderedDict[str, T] = OrderedDict()  # name -> adapter, least recent first
        self.pins: dict[str, int] = {}  # name -> running requests using it (on device only)
        self.free = list(range(max_loras, 0, -1))  # pop() hands out the lowest slot

    def slot_of(self, name: str) -> int | None:
        return self.device.get(name)

    def acquire(self, name: str) -> int:
        """Pin `name` on the device (loading it if needed) -> its slot. SlotsBusy when every
        slot is pinned; the loader's error when it cannot be read. Either way nothing changes."""
        if (slot := self.device.get(name)) is not None:
            self.device.move_to_end(name)
            self.host.move_to_end(name)
            self.pins[name] += 1
            return slot
        victim = None
        if not self.free:
            victim = next((n for n in self.device if self.pins[n] == 0), None)
            if victim is None:
                raise SlotsBusy(f"all {self.max_loras} LoRA slots hold adapters in use (max_loras)")
        adapter = self.host[name] if name in self.host else self._load(name)
        if victim is not None:  # it stays in the host cache (device ⊆ host)
            self.free.append(self.device.pop(victim))
            del self.pins[victim]
        slot = self.free.pop()
        self.host[name] = adapter
        self.host.move_to_end(name)
        self._trim_host(keep=name)
        self._write(slot, adapter)
        self.device[name], self.pins[name] = slot, 1
        return slot

    def preload(self, name: str, adapter: T) -> None:
        """Put `name` in the host cache (a newly added adapter, read and checked already)."""
        self.host[name] = adapter
        self.host.move_to_end(name)
        self._trim_host(keep=name)

    def release(self, name: str) -> None:
        """One request using `name` ended (it stays on the device until evicted)."""
        if self.pins.get(name, 0) < 1:
            raise ValueError(f"LoRA adapter {name!r} is not in use")
        self.pins[name] -= 1

    def remove(self, name: str) -> None:
        """Forget `name` (unloading it): AdapterInUse while requests use it."""
        if self.pins.get(name, 0) > 0:
            raise AdapterInUse(
                f"LoRA adapter {name!r} is in use by {self.pins[name]} running request(s)"
            )
        if name in self.device:
            self.free.append(self.device.pop(name))
            del self.pins[name]
        self.host.pop(name, None)

    def _trim_host(self, keep: str) -> None:
        """Drop the least recently used host copies beyond max_cpu_loras, never one on the
        device nor `keep` (on its way there). max_cpu_loras >= max_loras leaves enough."""
        idle = [n for n in self.host if n not in self.device and n != keep]
        for name in idle[: max(0, len(self.host) - self.max_cpu_loras)]:
            del self.host[name]


@dataclass
class ProjectionLora:
    """One projection's stacked adapters (this rank's shard)."""

    module: LinearBase
    parts: tuple[str, ...]  # the Hugging Face modules merged into it, in slice order
    rank: int  # r_max: each part's rank block
    a: torch.Tensor  # [slots, parts * rank, in]
    b: torch.Tensor  # [slots, out, rank], scaling folded in
    bounds: list[int]  # output row where each part starts, and the end: [parts + 1]
    offsets: torch.Tensor  # `bounds` on the device (int32), for the kernel
    # [A.view(-1, in); W]: `a` and the layer's weight are its views; None (set by
    # `layers.install`): decode steps take the shrink path
    joint: torch.Tensor | None = None

    def write(self, slot: int, parts: list[LoraWeights | None]) -> None:
        """Put an adapter's updates of this projection (None: a part it leaves alone) into
        `slot`, sharded like the layer."""
        a, b = self.a[slot], self.b[slot]
        a.zero_()
        b.zero_()
        for j, w in enumerate(parts):
            if w is None:
                continue
            r = w.rank
            scaled = w.b.float() * w.scaling
            module = self.module
            with torch.no_grad():  # the layers' loaders take a tensor for their parameter
                if isinstance(module, RowParallelLinear):  # A: this rank's input columns
                    module.load_weight(a[:r], w.a)  # type: ignore[arg-type]
                    b[:, :r].copy_(scaled)
                    continue
                a[j * self.rank : j * self.rank + r].copy_(w.a)
                if isinstance(module, MergedColumnParallelLinear):  # B: this rank's output rows
                    module.load_shard(b[:, :r], scaled, j)  # type: ignore[arg-type]
                else:
                    b[:, :r].copy_(scaled)


def part_bounds(module: LinearBase) -> list[int]:
    """Where each part's output rows start in the layer (this rank's), then its end."""
    if isinstance(module, MergedColumnParallelLinear):  # gate+up; q, k, v
        sizes = list(module.local_sizes)
    else:
        sizes = [module.weight.shape[0]]
    return [sum(sizes[:i]) for i in range(len(sizes) + 1)]


def _joint(module: LinearBase, a_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """([A; W], A): `a_rows` zero rows, then the layer's weight, which becomes a view of it
    (the old storage is freed)."""
    weight = module.weight
    joint = weight.new_zeros(a_rows + weight.shape[0], weight.shape[1])
    joint[a_rows:].copy_(weight.data)
    weight.data = joint[a_rows:]
    return joint, joint[:a_rows]


class LoraStack:
    """The device slots of every adapted projection of a model: `projections[(layer, name)]`
    (name: qkv_proj, o_proj, gate_up_proj or down_proj), `max_loras` slots plus slot 0."""

    def __init__(self, model: nn.Module, max_loras: int, max_rank: int) -> None:
        self.max_loras, self.max_rank = max_loras, max_rank
        self.projections: dict[tuple[int, str], ProjectionLora] = {}
        for name, module in model.named_modules():
            m = _PROJECTION.fullmatch(name)
            if m is None or m.group(2) not in MODULES or not isinstance(module, LinearBase):
                continue  # MoE experts and routers are not LinearBase projections
            parts = MODULES[m.group(2)]
            if module.weight.numel() == 0:  # the cpu extension's quantized layers
                raise ValueError(f"LoRA on quantized layers is not supported ({name})")
            joint, a = _joint(module, (max_loras + 1) * len(parts) * max_rank)
            bounds = part_bounds(module)
            b = torch.zeros(max_loras + 1, bounds[-1], max_rank, dtype=a.dtype, device=a.device)
            offsets = torch.tensor(bounds, dtype=torch.int32, device=a.device)
            key = (int(m.group(1)), m.group(2))
            a = a.view(max_loras + 1, len(parts) * max_rank, -1)
            self.projections[key] = ProjectionLora(
                module, parts, max_rank, a, b, bounds, offsets, joint
            )

    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` into `slot` of every projection (absent parts zero)."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot {slot} is not in 1..{self.max_loras}")
        if adapter.rank > self.max_rank:
            raise ValueError(f"LoRA adapter {adapter.name!r}: rank {adapter.rank} > max_rank")
        for (layer, name), proj in self.projections.items():
            proj.write(slot, adapter.layer_parts(layer, name))

    def clear(self, slot: int) -> None:
        for proj in self.projections.values():
            proj.a[slot].zero_()
            proj.b[slot].zero_()
