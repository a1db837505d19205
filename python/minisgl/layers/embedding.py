"""Vocab-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import all_gather_last_dim, all_reduce, get_tp_info
from minisgl.layers.base import Module
from minisgl.layers.linear import copy_checked, linear, narrow, set_weight_loader


class VocabParallelEmbedding(Module):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp_info()
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)  # ceil: the last shard is zero-padded
        self.vocab_start = tp.rank * self.shard_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        set_weight_loader(self.weight, self.load_weight)

    def load_weight(self, param: nn.Parameter, loaded: Any) -> None:
        size = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data.zero_()
        copy_checked(param.data[:size], narrow(loaded, 0, self.vocab_start, size))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if get_tp_info().size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Projects hidden states to logits over the full vocabulary (gathered across ranks)."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
