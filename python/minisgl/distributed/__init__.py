"""Tensor-parallel info and collectives. World size 1 makes every collective a no-op, so the
single-process path never touches torch.distributed."""

from __future__ import annotations

from dataclasses import dataclass

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
