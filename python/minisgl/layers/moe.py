"""Mixture-of-experts MLP: a top-k softmax router and experts whose intermediate dimension is
split across TP ranks (so every rank holds every expert's slice, and one all-reduce merges)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_reduce, divide, get_tp_info
from minisgl.layers.activation import silu_and_mul
from minisgl.layers.base import Module
from minisgl.layers.config import MoEConfig
from minisgl.layers.linear import ReplicatedLinear, copy_checked, narrow, set_weight_loader


class FusedExperts(Module):
    """All experts' weights stacked: w13 [E, 2*I, H] (gate then up), w2 [E, H, I]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.local_inter = divide(intermediate_size, get_tp_info().size, "moe_intermediate_size")
        i = self.local_inter
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * i, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, i), requires_grad=False)
        set_weight_loader(self.w13, self.load_w13)
        set_weight_loader(self.w2, self.load_w2)

    def load_w13(self, param: nn.Parameter, loaded: Any, shard_id: tuple[int, int]) -> None:
        expert, which = shard_id  # which: 0 = gate_proj, 1 = up_proj
        i = self.local_inter
        src = narrow(loaded, 0, get_tp_info().rank * i, i)
        copy_checked(param.data[expert, which * i : (which + 1) * i], src)

    def load_w2(self, param: nn.Parameter, loaded: Any, shard_id: int) -> None:
        i = self.local_inter
        copy_checked(param.data[shard_id], narrow(loaded, 1, get_tp_info().rank * i, i))


def moe_forward_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """Reference expert computation: gather each expert's tokens, run its MLP, scatter-add."""
    out = torch.zeros_like(x)
    for expert in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == expert)
        h = silu_and_mul(F.linear(x[token_idx], w13[expert]))
        h = F.linear(h, w2[expert]) * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, h.to(x.dtype))
    return out


class MoELayer(Module):
    def __init__(self, hidden_size: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk = cfg.top_k, cfg.norm_topk_prob
        self.run_experts = moe_forward_torch
        if cfg.backend == "triton":
            from minisgl.kernel.moe import fused_moe  # imports triton: only when chosen

            self.run_experts = fused_moe
        self.gate = ReplicatedLinear(hidden_size, cfg.num_experts)
        self.experts = FusedExperts(cfg.num_experts, hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        topk_weights, topk_ids = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
        w13, w2 = self.experts.w13, self.experts.w2
        return all_reduce(self.run_experts(x, w13, w2, topk_weights.to(x.dtype), topk_ids))
