"""The fused Gumbel-max sampler (python/minisgl/kernel/sampling.py) alone: `gumbel_argmax` over
[B, V] bf16 logits at a row temperature of 0.6, in a CUDA graph of one call per logits copy
(enough copies, >= 256 MiB, that no call finds its logits in L2), replayed and timed with CUDA
events. Prints us per call and the logits' GB/s for each batch; the ids are checked against
the torch path first. Session 26's 64-request timeline put the sampler at 44 us a step.

    python benchmark/kernels/sampling_bench.py                   # batches 1, 8, 64, 256
    python benchmark/kernels/sampling_bench.py --batch 64 --vocab 151936
    python benchmark/kernels/sampling_bench.py --smoke           # CPU, Triton interpreter"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))
from gemv_bench import time_us  # noqa: E402  (this directory: a graph of calls, replayed)


def bench(batch: int, vocab: int, cuda: bool) -> str:
    import torch

    from minisgl.engine.sample import sample
    from minisgl.kernel import sampling

    device = torch.device("cuda" if cuda else "cpu")
    gen = torch.Generator().manual_seed(batch)
    logits = (torch.randn(batch, vocab, generator=gen) * 3).to(device, torch.bfloat16)
    temperature = torch.full((batch,), 0.6, device=device)
    seed = torch.arange(batch, device=device) + 1
    step = torch.arange(batch, device=device) + 500
    got = sampling.gumbel_argmax(logits, temperature, seed, step)
    before = os.environ.get("MINISGL_DISABLE_FUSED_OPS")
    os.environ["MINISGL_DISABLE_FUSED_OPS"] = "1"  # the torch path, on CUDA too
    want = sample(logits, temperature, seed, step)
    if before is None:
        del os.environ["MINISGL_DISABLE_FUSED_OPS"]
    else:
        os.environ["MINISGL_DISABLE_FUSED_OPS"] = before
    same = (got == want).float().mean().item()
    nbytes = logits.numel() * logits.element_size()
    copies = max(1, -(-(256 << 20) // nbytes)) if cuda else 1
    ls = [logits] + [logits.clone() for _ in range(copies - 1)]
    us = time_us(lambda i: sampling.gumbel_argmax(ls[i], temperature, seed, step), copies, cuda)
    return (
        f"batch {batch:4d} x {vocab}: {us:9.2f} us  {nbytes / us / 1e3:7.0f} GB/s of logits"
        f"  (ids as the torch path's: {same:.0%})"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default=None, help="comma-separated batch sizes")
    p.add_argument("--vocab", type=int, default=None, help="default 151936 (smoke: 3000)")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, small shapes")
    args = p.parse_args()
    if args.smoke:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("sampling_bench.py needs a CUDA GPU (or --smoke for the CPU interpreter)")
    batches = [int(b) for b in (args.batch or ("1,3" if args.smoke else "1,8,64,256")).split(",")]
    vocab = args.vocab or (3000 if args.smoke else 151936)
    print(torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)")
    for batch in batches:
        print(bench(batch, vocab, cuda))


if __name__ == "__main__":
    main()
