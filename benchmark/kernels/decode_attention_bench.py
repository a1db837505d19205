"""The Triton paged decode attention (python/minisgl/kernel/triton_attention.py) alone, at the
offline benchmark's decode shapes: a batch of requests with random KV lengths on pages spread
over the pool, bf16 or fp8 KV, each (block_n, num_warps, num_stages) asked for, checked against
the torch reference first, then timed as the engine runs it (a CUDA graph of the split and merge
launches, replayed). The rate counts the K and V bytes the step must read (each request's
length x kv heads x head_dim x 2 x the pool's item size), against the data-sheet bandwidth.

    python benchmark/kernels/decode_attention_bench.py                       # bf16 and fp8
    python benchmark/kernels/decode_attention_bench.py --kv-dtype fp8_e4m3 \\
        --block-n 64,128 --num-warps 4,8 --num-stages 2,3 --num-splits 1,2
    python benchmark/kernels/decode_attention_bench.py --smoke               # CPU interpreter"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))

KV_DTYPES = {"bf16": "bfloat16", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def add_common_args(p: argparse.ArgumentParser, kv_dtype: str) -> None:
    """The attention benches' shared options: the model's attention shape, the KV pool, the
    timing and the CPU smoke mode."""
    p.add_argument("--heads", type=int, default=16, help="query heads (Qwen3-0.6B: 16)")
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", default=kv_dtype, help=f"of {', '.join(KV_DTYPES)}")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, Triton's CPU interpreter")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--min-len", type=int, default=300, help="shortest KV length")
    p.add_argument("--max-len", type=int, default=1800, help="longest KV length")
    add_common_args(p, "bf16,fp8_e4m3")
    p.add_argument("--block-n", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--num-warps", type=ints, default=[4])
    p.add_argument("--num-stages", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--num-splits", type=ints, default=None, help="default: decode_splits'")
    p.add_argument(
        "--order",
        default="lpt",
        help="programs' request order, comma-separated: lpt (longest first, as the engine) or"
        " none (the batch's)",
    )
    p.add_argument(
        "--maxnreg",
        type=ints,
        default=None,
        help="register caps, 0: none (default: decode_tuning's)",
    )
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.min_len, args.max_len, args.heads, args.kv_heads = 3, 5, 40, 4, 2
        args.head_dim, args.page_size, args.reps = 16, 4, 1
    return args


def build(args: argparse.Namespace, kv_dtype: str, device):
    """(q, k_pool, v_pool, page_table, rows, kv_lens, lengths): each request's pages a random
    subset of the pool, as after a run's allocations and frees."""
    import torch

    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.min_len, args.max_len + 1, (args.batch,), generator=gen)
    pages = [math.ceil(n / args.page_size) for n in lengths.tolist()]
    order = torch.randperm(sum(pages), generator=gen).to(torch.int32)
    table = torch.zeros(args.batch, max(pages), dtype=torch.int32)
    start = 0
    for i, n in enumerate(pages):
        table[i, :n] = order[start : start + n]
        start += n
    slots = sum(pages) * args.page_size
    dtype = getattr(torch, KV_DTYPES[kv_dtype])
    if args.smoke and dtype == torch.bfloat16:  # the interpreter has no bfloat16 loads
        dtype = torch.float16
    k, v = (
        torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in range(2)
    )
    q_dtype = torch.float16 if args.smoke else torch.bfloat16
    q = torch.randn(args.batch, args.heads, args.head_dim, generator=gen).to(q_dtype)
    rows = torch.arange(args.batch, dtype=torch.int32)
    moved = (t.to(device) for t in (q, k, v, table, rows, lengths.to(torch.int32)))
    return (*moved, lengths)


def reference(q, k_pool, v_pool, table, lengths, page_size: int, scale: float):
    """Each request's attention from its gathered KV in float32 (the check, not the timing)."""
    import torch

    outs = []
    group = q.shape[1] // k_pool.shape[1]
    for i, n in enumerate(lengths.tolist()):
        pos = torch.arange(n, device=q.device)
        slot = table[i, pos // page_size].long() * page_size + pos % page_size
        k = k_pool[slot].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_pool[slot].float().repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].float(), k) * scale
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v))
    return torch.stack(outs)


def time_us(fn, reps: int, cuda: bool) -> float:
    import time

    import torch

    fn()
    if not cuda:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / reps


def bench_dtype(args: argparse.Namespace, kv_dtype: str, device, peak: float | None) -> None:
    import torch

    from minisgl.kernel import triton_attention as ta

    q, k_pool, v_pool, table, rows, kv_lens, lengths = build(args, kv_dtype, device)
    scale = args.head_dim**-0.5
    default_splits = ta.decode_splits(args.batch, args.kv_heads, ta.num_sms(device))
    nbytes = int(lengths.sum()) * args.kv_heads * args.head_dim * 2 * k_pool.element_size()
    default = ta.decode_tuning(k_pool, default_splits)
    ref = reference(q, k_pool, v_pool, table, lengths, args.page_size, scale)
    print(f"{kv_dtype}: batch {args.batch}, KV {args.min_len}-{args.max_len}, {default_splits}"
          f" splits, {nbytes / 1e9:.3f} GB a step; default {default}")  # fmt: skip
    configs = itertools.product(
        args.num_splits or [default_splits],
        args.block_n or [default.block_n],
        args.num_warps,
        args.num_stages or [default.num_stages],
        args.maxnreg or [default.maxnreg or 0],
        args.order.split(","),
    )
    longest_first = torch.argsort(lengths, descending=True, stable=True).to(torch.int32)
    for splits, block_n, warps, stages, regs, order in configs:
        tuning = ta.DecodeTuning(block_n, stages, regs or None)
        perm = longest_first.to(device) if order == "lpt" else None

        def step(splits=splits, tuning=tuning, warps=warps, perm=perm) -> torch.Tensor:
            return ta.decode_attention(
                q, k_pool, v_pool, table, rows, kv_lens, splits, args.page_size, scale,
                tuning=tuning, num_warps=warps, order=perm,
            )  # fmt: skip

        label = f"splits {splits:2d} block_n {block_n:4d} warps {warps} stages {stages} regs {regs}"
        label += f" order {order}"
        report(label, step, ref, args.reps, device.type == "cuda", nbytes / 1e12, "TB/s", peak)


def report(
    label: str, step: Callable[[], Any], ref: Any, reps: int, cuda: bool, work: float, unit: str,
    peak: float | None,
) -> None:  # fmt: skip
    """Check `step`'s output against `ref` (a configuration that cannot compile or is wrong
    says so), time it and print its us and `work` (in `unit` x 1e12) per second."""
    try:
        err = (step().float() - ref).abs().max().item()
    except Exception as e:  # e.g. a tile larger than the shared memory: skip it
        print(f"  {label}: fails ({type(e).__name__}: {str(e)[:80]})")
        return
    if err > 5e-2:
        print(f"  {label}: WRONG, max error {err:.3g}")
        return
    us = time_us(step, reps, cuda)
    rate = work / us * 1e6
    share = f" ({rate / peak:.0%} of {peak:g})" if peak else ""
    print(f"  {label}: {us:8.1f} us  {rate:6.2f} {unit}{share}  max error {err:.2g}")


def setup(smoke: bool, peak_index: int) -> tuple[Any, float | None]:
    """The device (Triton's CPU interpreter with --smoke) and its data-sheet peak in units of
    1e12: GPU_PEAKS[gpu][peak_index] (0: bytes/s, 1: bf16 FLOP/s); None where unknown."""
    if smoke:
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    device = torch.device("cpu" if smoke else "cuda")
    if device.type != "cuda":
        return device, None
    sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))
    from bench import GPU_PEAKS

    name = torch.cuda.get_device_name()
    print(name)
    return device, next((v[peak_index] / 1e12 for k, v in GPU_PEAKS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, peak = setup(args.smoke, 0)
    for kv_dtype in args.kv_dtype.split(","):
        if kv_dtype not in KV_DTYPES:
            print(f"error: --kv-dtype {kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
            return 2
        bench_dtype(args, kv_dtype, device, peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
