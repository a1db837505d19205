"""Tensor-parallel info, group and collectives; at world size 1 none touches torch.distributed."""

# With TP size N every rank runs the same scheduler and engine; the model's collectives go over
# the default group (NCCL on CUDA, gloo on CPU) and rank 0's small control messages (new
# requests, aborts) over a gloo group of their own, whose timeout is long because followers wait
# there while the server is idle. On one machine nothing listens beyond it: the ranks meet
# through a file in a private directory (not a TCP store, which listens on every interface) and
# gloo's and NCCL's sockets stay on the loopback interface unless the user chose one
# (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). The serving extension meets across machines.
# torch is imported inside the functions that use it: the API process names a Rendezvous
# (server/launch.py) and must not load torch (issue 47).

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class DistributedInfo:
    rank: int = 0
    size: int = 1


_TP_INFO = DistributedInfo()
_CONTROL: Any = None  # the gloo group of rank 0's control messages
START_TIMEOUT_S = 120  # joining the group, and any one model collective


def set_tp_info(info: DistributedInfo) -> None:
    global _TP_INFO
    _TP_INFO = info


def get_tp_info() -> DistributedInfo:
    return _TP_INFO


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the TP ranks, in place."""
    if _TP_INFO.size > 1:
        import torch.distributed as dist

        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's `x` along the last dimension (vocab-parallel logits)."""
    if _TP_INFO.size == 1:
        return x
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(_TP_INFO.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the TP size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class Rendezvous:
    """Where a TP group's ranks meet: the file `path` (not there yet) in a private directory.
    Rank r drives GPU r + `device_shift` (a --dp replica's GPUs follow the previous one's)."""

    path: str = ""
    device_shift: int = 0

    def join(self, rank: int, size: int, backend: str) -> None:
        import torch.distributed as dist

        stay_on_loopback(backend)
        timeout = timedelta(seconds=START_TIMEOUT_S)
        dist.init_process_group(backend, f"file://{self.path}", timeout, world_size=size, rank=rank)


def stay_on_loopback(backend: str) -> None:
    """gloo's and NCCL's sockets on the loopback interface, unless the user chose one."""
    names = {name for _, name in socket.if_nameindex()}
    loopback = next((name for name in ("lo", "lo0") if name in names), "lo")  # Linux, macOS
    os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # read when a gloo group is made
    if backend == "nccl":
        os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)  # NCCL's bootstrap sockets


def rendezvous_file(directory: str, name: str = "tp-rendezvous", shift: int = 0) -> Rendezvous:
    return Rendezvous(os.path.join(directory, name), device_shift=shift)


def select_device(rank: int, meet: Rendezvous | None) -> None:
    """CUDA: make rank's GPU the current device, before NCCL and the engine use it."""
    if meet is not None and (rank or meet.device_shift):
        import torch

        torch.cuda.set_device(rank + meet.device_shift)


def init_tp(rank: int, size: int, meet: Rendezvous, device_type: str) -> None:
    """Join the TP group of `size` processes, which meet at `meet`."""
    import torch.distributed as dist

    global _CONTROL
    meet.join(rank, size, "nccl" if device_type == "cuda" else "gloo")
    _CONTROL = dist.new_group(backend="gloo", timeout=timedelta(days=3650))
    set_tp_info(DistributedInfo(rank, size))


def destroy_tp() -> None:
    import torch.distributed as dist

    global _CONTROL
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL = None
    set_tp_info(DistributedInfo())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (any picklable value; the others pass None)."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (KV pool sizes must agree)."""
    if _TP_INFO.size == 1:
        return value
    import torch.distributed as dist

    values = [0] * _TP_INFO.size
    dist.all_gather_object(values, value, group=_CONTROL)
    return min(values)


def check_tp_size(
    size: int, num_heads: int, num_kv_heads: int, device: str, gpus: int | None = None
) -> None:
    """Clear errors for a TP size the model or the machine cannot take (`device`: the option,
    e.g. "auto"; `gpus`: what this machine needs, when not `size`)."""
    from minisgl.utils.device import gpus_short

    if size < 1:
        raise ValueError(f"invalid TP size {size}: must be >= 1")
    need = size if gpus is None else gpus
    if (found := gpus_short(device, need)) is not None:
        raise ValueError(f"TP size {size} needs {need} GPUs, found {found}")
    if num_heads % size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by TP size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and TP size {size}: one must divide the other"
            " (KV heads are split across ranks, or replicated when fewer than the ranks)"
        )
