"""A float32 model's eager steps through minisgl's fused CPU kernels (fused.cpp, built by
native.py): RMSNorm with its residual add, and SiLU-and-mul, in one pass over each row where
torch makes 3-6 (a 1,000-token prompt's gate/up output is 12 MB: each pass goes to memory).
`install_fused` gives the model's RMSNorm and MLP modules these subclasses (each keeps its
loaded weights; only the forward changes). They take torch's path while compiling (inductor
fuses these itself), for other dtypes, and where the kernels do not run. Their outputs are within
float32 rounding of torch's, not bit for bit (the mean of squares and the exp are summed and
computed in another order); speed.py's RoPE through the same library keeps torch's bits.
A long prompt's MLP whose gate/up projection `packed.py` routes takes `packed.gated_silu`."""

from __future__ import annotations

import torch

from minisgl.ext.cpu import native
from minisgl.ext.cpu.packed import gated_silu
from minisgl.layers.norm import RMSNorm
from minisgl.models.llama import MLP


def fused_ready(x: torch.Tensor) -> bool:
    """x can take a fused kernel now: float32, eager, and the kernels loaded."""
    return (
        x.dtype == torch.float32 and not torch.compiler.is_compiling() and native.float32_kernels()
    )


class FusedRMSNorm(RMSNorm):
    def norm(self, x: torch.Tensor) -> torch.Tensor:
        if fused_ready(x):
            return torch.ops.minisgl.rms_norm(x, self.weight, self.eps)
        return super().norm(x)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dense = residual is not None and x.is_contiguous() and residual.is_contiguous()
        if residual is None or not (dense and fused_ready(x)):
            return super().forward(x, residual)
        # in place, as the core's path: residual += x, x = the normed sum
        torch.ops.minisgl.add_rms_norm_(x, residual, self.weight, self.eps)
        return x, residual


class FusedMLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not fused_ready(x):
            return super().forward(x)
        gated = gated_silu(self.gate_up_proj, x)  # a long prompt's, on oneDNN's packed halves
        if gated is None:
            gated = torch.ops.minisgl.silu_and_mul(self.gate_up_proj(x))
        return self.down_proj(gated)


def install_fused(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """A float32 model's RMSNorm and MLP modules become the fused ones, where the kernels run."""
    if dtype != torch.float32 or not native.float32_kernels():
        return
    for module in model.modules():
        if type(module) is RMSNorm:
            module.__class__ = FusedRMSNorm
        elif type(module) is MLP:
            module.__class__ = FusedMLP
