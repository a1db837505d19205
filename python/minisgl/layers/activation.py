import torch
import torch.nn.functional as F

from minisgl import kernel


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """Reference: x = [gate | up] along the last dim -> silu(gate) * up; the CPU path."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if (ops := kernel.fused_ops(x)) is not None:
        return ops.silu_and_mul(x)
    return silu_and_mul_torch(x)
