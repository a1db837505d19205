"""Tensor-parallel linear layers; each parameter's `weight_loader` copies this rank's shard."""

# A loader reads a checkpoint tensor or a lazy safetensors slice: no rank reads more than its
# shard.

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import kernel
from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.layers.base import Module

# (param, loaded[, shard id]): copies this rank's part of a checkpoint tensor into param
WeightLoader = Callable[..., None]


def set_weight_loader(param: nn.Parameter, loader: WeightLoader) -> None:
    param.weight_loader = loader  # type: ignore[attr-defined]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or the GEMV kernel for decode-sized batches on CUDA (`kernel.gemv_ops`)."""
    if (ops := kernel.gemv_ops(x, weight)) is not None:
        return ops.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def narrow(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """Slice `loaded` (a tensor or a safetensors slice) along `dim` without reading the rest."""
    return torch.as_tensor(loaded[(slice(None),) * dim + (slice(start, start + length),)])


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"shape mismatch: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
    dst.copy_(src)


def load_replicated(param: nn.Parameter, loaded: Any) -> None:
    copy_checked(param.data, torch.as_tensor(loaded[...]))


class LinearBase(Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x W^T (the cpu extension's quantized layers replace it and `forward`)."""
        return linear(x, self.weight)

    def set_loaders(self, weight_loader: WeightLoader, bias_loader: WeightLoader) -> None:
        set_weight_loader(self.weight, weight_loader)
        if self.bias is not None:
            set_weight_loader(self.bias, bias_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class ReplicatedLinear(LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.set_loaders(load_replicated, load_replicated)


class MergedColumnParallelLinear(LinearBase):
    """Several column-parallel outputs in one matmul (gate+up); shard id = index in `out_sizes`."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False) -> None:
        tp = get_tp_info()
        local_sizes = [divide(n, tp.size, "output features") for n in out_sizes]
        self._init_parts(in_features, local_sizes, [tp.rank] * len(out_sizes), bias)

    def _init_parts(
        self, in_features: int, local_sizes: list[int], blocks: list[int], bias: bool
    ) -> None:
        """Part i: this rank's `local_sizes[i]` rows, block `blocks[i]` of its checkpoint tensor."""
        self.local_sizes, self.blocks = local_sizes, blocks
        super().__init__(in_features, sum(local_sizes), bias)
        self.set_loaders(self.load_shard, self.load_shard)

    def load_shard(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        size, offset = self.local_sizes[shard_id], sum(self.local_sizes[:shard_id])
        src = narrow(loaded, 0, self.blocks[shard_id] * size, size)
        copy_checked(param.data.narrow(0, offset, size), src)


class QKVParallelLinear(MergedColumnParallelLinear):
    """Q, K and V (shard ids 0, 1, 2) in one matmul. KV heads are split across ranks, or
    replicated when there are fewer KV heads than ranks."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp_info()
        self.q_size = divide(num_heads, tp.size, "num_attention_heads") * head_dim
        if num_kv_heads >= tp.size:
            self.kv_size = divide(num_kv_heads, tp.size, "num_key_value_heads") * head_dim
            kv_block = tp.rank
        else:  # one KV head a rank, the same for each group of tp.size // num_kv_heads ranks
            # (check_tp_size, before any rank starts, refuses a TP size they do not divide)
            self.kv_size, kv_block = head_dim, tp.rank // (tp.size // num_kv_heads)
        sizes = [self.q_size, self.kv_size, self.kv_size]
        self._init_parts(hidden_size, sizes, [tp.rank, kv_block, kv_block], bias)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; partial sums all-reduced, bias added once after."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        in_features = divide(in_features, get_tp_info().size, "input features")
        super().__init__(in_features, out_features, bias)
        self.set_loaders(self.load_weight, load_replicated)

    def load_weight(self, param: nn.Parameter, loaded: Any) -> None:
        size = param.shape[1]
        copy_checked(param.data, narrow(loaded, 1, get_tp_info().rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(self.matmul(x))
        return y if self.bias is None else y + self.bias
