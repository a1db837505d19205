"""How the cpu extension's layers take over a model's projections: the core's layers compute with
their dense weight, so instance attributes (which win over the class's methods) replace
`forward` (and `matmul`, which RowParallelLinear.forward calls). The kernel is called straight:
no module call per projection, which costs on a CPU decode step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from minisgl.distributed import all_gather_last_dim
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import LinearBase, RowParallelLinear


def projections(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, (LinearBase, ParallelLMHead))]


def route_through(
    module: Any,
    matmul: Callable[[torch.Tensor], torch.Tensor],
    forward: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """x W^T of a projection (or the LM head) through `matmul`; `forward`, with the bias, by
    default matmul's result plus the bias."""
    if isinstance(module, ParallelLMHead):
        vocab = module.vocab_size

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            return all_gather_last_dim(matmul(hidden))[..., :vocab]

        module.forward = logits  # type: ignore[method-assign]
        return
    module.matmul = matmul  # RowParallelLinear.forward: all_reduce(matmul(x)) + bias
    if isinstance(module, RowParallelLinear):
        return
    if forward is None:

        def forward(x: torch.Tensor) -> torch.Tensor:
            y = matmul(x)
            return y if module.bias is None else y + module.bias

    module.forward = forward
