"""Tensor-parallel info and collectives. World size 1 makes every collective a no-op, so the
single-process path never touches torch.distributed.

With TP size N every rank runs the same scheduler and engine; the model's collectives go over
the default group (NCCL on CUDA, gloo on CPU) and rank 0's small control messages (new
requests, aborts) over a gloo group of their own, whose timeout is long because followers wait
there while the server is idle. A rank that dies closes its sockets, so the others' collectives
fail at once instead of hanging.

On one machine nothing listens beyond it: the ranks meet through a file (a torch FileStore in a
directory only this user can read), not a TCP store (whose server listens on every interface),
and gloo's and NCCL's own sockets are bound to the loopback interface unless the user chose one
(GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME). Across machines (--nnodes) the ranks meet at a TCP
store that rank 0 hosts at --dist-init-addr; a rank that cannot reach it, or a group that
misses ranks, fails after --dist-timeout seconds."""

from __future__ import annotations

import ipaddress
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedInfo:
    rank: int = 0
    size: int = 1

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"invalid tensor-parallel rank {self.rank} of size {self.size}")

    @property
    def is_primary(self) -> bool:
        return self.rank == 0


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
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    """Concatenate each rank's `x` along the last dimension (vocab-parallel logits)."""
    if _TP_INFO.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_INFO.size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what} ({numerator}) is not divisible by the TP size ({denominator})")
    return numerator // denominator


@dataclass(frozen=True)
class Rendezvous:
    """Where a TP group's ranks meet: the file `path` on one machine, else the TCP store at
    `addr` (HOST:PORT, --dist-init-addr) within `timeout_s`. Rank r drives GPU
    r + `device_shift` of its machine (a --dp replica's GPUs follow the previous replica's; on
    node k of several, the node's first rank drives GPU 0)."""

    path: str = ""
    addr: str | None = None
    timeout_s: float = START_TIMEOUT_S
    device_shift: int = 0


def rendezvous_file(directory: str, name: str = "tp-rendezvous", shift: int = 0) -> Rendezvous:
    """The ranks meet through a file in `directory` (the caller's private temp directory,
    removed by the caller), which must not exist yet."""
    return Rendezvous(os.path.join(directory, name), device_shift=shift)


def _loopback_interface() -> str:
    names = {name for _, name in socket.if_nameindex()}
    return next((name for name in ("lo", "lo0") if name in names), "lo")  # Linux, macOS


def select_device(rank: int, meet: Rendezvous | None) -> None:
    """CUDA: make rank's GPU (see `Rendezvous`) the current device, before NCCL creates its
    communicator and the engine its tensors."""
    if meet is not None and (rank or meet.device_shift):
        torch.cuda.set_device(rank + meet.device_shift)


def split_addr(addr: str) -> tuple[str, int]:
    """HOST:PORT (an IPv6 host in brackets) -> (host, port); ValueError naming the problem."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"must be HOST:PORT with a port in 1..65535, got {addr!r}")
    return host, int(port)


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _tcp_store(rank: int, size: int, meet: Rendezvous) -> dist.TCPStore:
    assert meet.addr is not None
    host, port = split_addr(meet.addr)
    try:
        return dist.TCPStore(
            host,
            port,
            size,
            is_master=rank == 0,
            timeout=timedelta(seconds=meet.timeout_s),
            wait_for_workers=False,
        )
    except (RuntimeError, OSError) as e:  # torch's DistNetworkError / DistStoreError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RuntimeError(
            f"--dist-init-addr {meet.addr}: rank {rank} could not "
            f"{'listen there' if rank == 0 else 'reach it'} within --dist-timeout "
            f"{meet.timeout_s:g} s ({first})"
        ) from None


def init_tp(rank: int, size: int, meet: Rendezvous, device_type: str) -> None:
    """Join the TP group of `size` processes, which meet at `meet` (on CUDA, the caller has
    set this rank's device: `select_device`)."""
    global _CONTROL
    if meet.addr is None or _is_loopback(split_addr(meet.addr)[0]):
        loopback = _loopback_interface()
        os.environ.setdefault("GLOO_SOCKET_IFNAME", loopback)  # read when a gloo group is made
        if device_type == "cuda":
            os.environ.setdefault("NCCL_SOCKET_IFNAME", loopback)  # NCCL's bootstrap sockets
    if meet.addr is None:
        where: dict[str, Any] = {"init_method": f"file://{meet.path}"}
    else:
        where = {"store": _tcp_store(rank, size, meet)}
    try:
        dist.init_process_group(
            "nccl" if device_type == "cuda" else "gloo",
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=meet.timeout_s),
            **where,
        )
    except (RuntimeError, OSError) as e:
        if meet.addr is None:
            raise
        raise RuntimeError(
            f"TP rank {rank}: the group of {size} ranks at --dist-init-addr {meet.addr} did not "
            f"form within --dist-timeout {meet.timeout_s:g} s ({type(e).__name__})"
        ) from None
    _CONTROL = dist.new_group(backend="gloo", timeout=timedelta(days=3650))
    set_tp_info(DistributedInfo(rank, size))


def destroy_tp() -> None:
    global _CONTROL
    if dist.is_initialized():
        dist.destroy_process_group()
    _CONTROL = None
    set_tp_info(DistributedInfo())


def broadcast_object(obj: Any) -> Any:
    """Rank 0's `obj` on every rank (any picklable value; the others pass None)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_CONTROL)
    return box[0]


def all_reduce_min(value: int) -> int:
    """The smallest of every rank's `value` (KV pool sizes must agree)."""
    if _TP_INFO.size == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=_CONTROL)
    return int(t.item())


def check_tp_size(
    size: int, num_heads: int, num_kv_heads: int, device_type: str, gpus: int | None = None
) -> None:
    """Clear errors for a TP size the model or the machine cannot take (`gpus`: what this
    machine needs, when not `size`)."""
    if size < 1:
        raise ValueError(f"invalid TP size {size}: must be >= 1")
    need = size if gpus is None else gpus
    if device_type == "cuda" and need > torch.cuda.device_count():
        raise ValueError(f"TP size {size} needs {need} GPUs, found {torch.cuda.device_count()}")
    if num_heads % size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by TP size {size}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads ({num_kv_heads}) and TP size {size}: one must divide the other"
            " (KV heads are split across ranks, or replicated when fewer than the ranks)"
        )
