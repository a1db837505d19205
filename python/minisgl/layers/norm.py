from __future__ import annotations

import torch
from torch import nn

from minisgl import kernel
from minisgl.layers.linear import load_replicated


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Reference RMSNorm over the last dim, in float32 like transformers; the CPU path."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class RMSNorm(nn.Module):
    """RMSNorm; `forward(x, residual)` fuses the residual add and returns (normed, new_residual).
    On CUDA the Triton kernels run (kernel/fused.py) and the fused add works in place: x's
    buffer receives the normed output and residual's the new residual, so callers must not
    reuse the tensors they passed in (the decoder layers never do)."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = load_replicated

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, N] or [T, heads, N] (Qwen3's q/k norm) -> a new normed tensor."""
        if (ops := kernel.fused_ops(x)) is not None:
            return ops.rms_norm(x, self.weight, self.eps)
        return rms_norm_torch(x, self.weight, self.eps)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self.norm(x), x
        if (ops := kernel.fused_ops(x)) is not None:
            ops.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        x = x + residual
        return rms_norm_torch(x, self.weight, self.eps), x
