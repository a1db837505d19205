"""Can one half of a decode batch's attention hide the other half's GEMMs (NanoFlow-style
intra-device overlap)? At the offline benchmark's decode shapes (Qwen3-0.6B's layers, 256
requests of 300-1,800 KV positions), a CUDA graph of every layer, replayed and timed per layer:

- `attention` / `gemms`: the Triton decode attention alone, the four projections alone
  (qkv, o, gate_up, down: cuBLAS through torch, as the engine runs them at these rows);
- `sequential`: attention then GEMMs on the whole batch (what the engine does);
- `halves`: the same on each half in turn (what splitting costs);
- `overlapped`: each layer twice, a half's attention on the main stream while the other half's
  GEMMs run on a second one, joined after each.

Overlap pays only if `overlapped` is below `sequential`. The halves split the requests by KV
length, alternately, so each half has the same attention work. Each layer has its own weights
(no L2 hits); one KV pool serves every layer (a step's KV is many times L2).

    python benchmark/kernels/overlap_bench.py                    # bf16 KV, 256 requests
    python benchmark/kernels/overlap_bench.py --kv-dtype fp8_e4m3 --batch 128
    python benchmark/kernels/overlap_bench.py --smoke            # CPU interpreter, no streams"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_attention_bench as dab  # noqa: E402 (also puts python/ on the path)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=256, help="requests (even)")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1800)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    dab.add_common_args(p, "bf16")
    args = p.parse_args(argv)
    if args.kv_dtype not in dab.KV_DTYPES:
        p.error(f"--kv-dtype {args.kv_dtype!r}: expected one of {', '.join(dab.KV_DTYPES)}")
    if args.batch < 2 or args.batch % 2:
        p.error(f"--batch {args.batch}: an even number of at least 2")
    if args.smoke:
        args.batch, args.min_len, args.max_len, args.heads, args.kv_heads = 4, 5, 40, 4, 2
        args.head_dim, args.page_size, args.reps, args.layers = 16, 4, 1, 2
        args.hidden, args.intermediate = 32, 48
    return args


def attention_steps(args: argparse.Namespace, device) -> tuple[Callable, list[Callable]]:
    """(attention of the whole batch, [attention of each half]), graph-safe callables; each
    half checked to give its rows of the whole batch's output."""
    import torch

    from minisgl.kernel import triton_attention as ta

    q, k_pool, v_pool, table, rows, kv_lens, lengths = dab.build(args, args.kv_dtype, device)
    longest_first = torch.argsort(lengths, descending=True).to(device)

    def step_for(index: torch.Tensor) -> Callable:
        q_i, rows_i, lens_i = q[index].contiguous(), rows[index].contiguous(), kv_lens[index]
        order = torch.argsort(lens_i, descending=True).to(torch.int32)
        splits = ta.decode_splits(len(index), args.kv_heads, ta.num_sms(device))
        operands = (q_i, k_pool, v_pool, table, rows_i, lens_i.contiguous(), splits)
        scale = args.head_dim**-0.5
        return lambda: ta.decode_attention(*operands, args.page_size, scale, order=order)

    whole = step_for(torch.arange(args.batch, device=device))
    index = [longest_first[i::2] for i in (0, 1)]
    halves = [step_for(i) for i in index]
    expected = whole()  # each half's rows must be the whole batch's (up to the splits' sums)
    for rows_i, step in zip(index, halves):
        torch.testing.assert_close(step(), expected[rows_i], rtol=0, atol=2e-2)
    return whole, halves


def gemm_steps(args: argparse.Namespace, device) -> Callable[[int, int], None]:
    """gemms(layer, rows): that layer's four projections on `rows` rows."""
    import torch

    dtype = torch.float32 if args.smoke else torch.bfloat16
    hidden, inter = args.hidden, args.intermediate
    q_dim, kv_dim = args.heads * args.head_dim, args.kv_heads * args.head_dim
    shapes = ((q_dim + 2 * kv_dim, hidden), (hidden, q_dim), (2 * inter, hidden), (hidden, inter))
    weights = [
        [torch.randn(n, k, device=device, dtype=dtype) * 0.02 for n, k in shapes]
        for _ in range(args.layers)
    ]
    widest = max(k for _, k in shapes)
    inputs = {
        m: torch.randn(m, widest, device=device, dtype=dtype) for m in (args.batch, args.batch // 2)
    }

    def gemms(layer: int, rows: int) -> None:
        for w in weights[layer]:
            inputs[rows][:, : w.shape[1]] @ w.T

    return gemms


def variants(args: argparse.Namespace, device) -> dict[str, Callable[[], None]]:
    import torch

    whole, halves = attention_steps(args, device)
    gemms, layers, half = gemm_steps(args, device), range(args.layers), args.batch // 2
    side = torch.cuda.Stream(device) if device.type == "cuda" else None

    def overlapped() -> None:
        main = torch.cuda.current_stream() if side is not None else None
        for layer in layers:
            for i in (0, 1):
                if side is None:  # the smoke run: the same work, one after the other
                    halves[i]()
                    gemms(layer, half)
                    continue
                side.wait_stream(main)
                halves[i]()
                with torch.cuda.stream(side):
                    gemms(layer, half)
                main.wait_stream(side)

    def attention() -> None:
        for _ in layers:
            whole()

    def projections() -> None:
        for layer in layers:
            gemms(layer, args.batch)

    def sequential() -> None:
        for layer in layers:
            whole()
            gemms(layer, args.batch)

    def in_halves() -> None:
        for layer in layers:
            for step in halves:
                step()
                gemms(layer, half)

    return {
        "attention": attention,
        "gemms": projections,
        "sequential": sequential,
        "halves": in_halves,
        "overlapped": overlapped,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, _ = dab.setup(args.smoke, 0)
    print(f"{args.kv_dtype} KV, {args.batch} requests of {args.min_len}-{args.max_len}, "
          f"{args.layers} layers")  # fmt: skip
    for name, step in variants(args, device).items():
        us = dab.time_us(step, args.reps, device.type == "cuda") / args.layers
        print(f"  {name:10s} {us:9.1f} us a layer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
