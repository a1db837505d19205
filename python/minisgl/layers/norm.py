from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl import kernel
from minisgl.layers.base import Module
from minisgl.layers.linear import load_replicated, set_weight_loader


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Reference RMSNorm over the last dim, in float32 like transformers; the CPU path."""
    # weight * the normed x rounded to x's dtype; F.rms_norm is that formula bit for bit, its
    # float32 math inside one call from Python.
    return torch.mul(weight, F.rms_norm(x, x.shape[-1:], None, eps), out=out)


class RMSNorm(Module):
    """RMSNorm with the residual add fused in: kernel/fused.py on CUDA, else the reference."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        set_weight_loader(self.weight, load_replicated)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N] or [T, heads, N] (Qwen3's q/k norm) -> a new normed tensor."""
        if (ops := kernel.fused_ops(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (normed, new residual); a given residual and x are consumed (reused in place)."""
        # Without a residual, x is only read and is the new residual. With one, residual's
        # buffer receives x + residual and x's the normed sum: callers must not reuse them.
        if residual is None:
            return self.norm(x), x
        if (ops := kernel.fused_ops(x)) is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
        else:  # residual + x is bit for bit x + residual, so CPU results stay transformers'
            rms_norm_torch(residual.add_(x), self.weight, self.eps, out=x)
        return x, residual
