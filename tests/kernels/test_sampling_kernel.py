"""The fused Gumbel-max sampler (kernel/sampling.py) with skipped rows: a CUDA graph's sampling
passes the rows its step samples again (engine `forward_step`'s resample), giving 0 there and
the same ids elsewhere. On CUDA at Qwen3's vocabulary, otherwise under the Triton interpreter."""

from __future__ import annotations

import pytest
import torch

from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton

DEVICE = torch.device("cuda" if CUDA else "cpu")
SHAPES = [(5, 151936), (256, 151936)] if CUDA else [(5, 3000), (3, 20000)]


def on_device(test):
    """A kernel test: marked gpu where it runs on CUDA (elsewhere it runs interpreted)."""
    return pytest.mark.gpu(test) if CUDA else test


@on_device
@pytest.mark.parametrize("shape", SHAPES)
def test_skipped_rows_are_left_out(shape):
    ops = kernel_module("sampling")
    batch, vocab = shape
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(DEVICE)
    temperature = torch.tensor([0.0, 0.7, 1.3] * batch)[:batch].to(DEVICE)
    seed = torch.arange(batch, device=DEVICE) * 7 + 1
    step = torch.arange(batch, device=DEVICE) + 100
    skip = (torch.arange(batch, device=DEVICE) % 2).long()
    full = ops.gumbel_argmax(logits, temperature, seed, step)
    part = ops.gumbel_argmax(logits, temperature, seed, step, skip)
    kept = skip == 0
    assert torch.equal(part[kept], full[kept])
    assert not bool(part[~kept].any())
    assert torch.equal(full[0], logits[0].argmax())  # row 0 is greedy
