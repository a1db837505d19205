"""The Triton paged extend (prefill) attention (python/minisgl/kernel/triton_attention.py) alone:
a batch of requests, each with --cached-len positions already in the KV pool and --extend-len
new tokens that attend causally to those and to themselves, on pages spread over the pool.
Each (block_m, block_n, num_warps, num_stages) asked for is checked against the torch
reference first, then timed as a CUDA graph replayed. The rate counts the causal attention's
matrix FLOPs (4 x head_dim per query-key pair that is not masked) against the dense bf16 peak.

    python benchmark/kernels/extend_attention_bench.py                  # 16 prompts of 512
    python benchmark/kernels/extend_attention_bench.py --batch 1 --extend-len 2000
    python benchmark/kernels/extend_attention_bench.py --decode-rows 128   # a mixed step
    python benchmark/kernels/extend_attention_bench.py --block-m 64,128 --block-n 32,64 \\
        --num-warps 4,8 --num-stages 2,3
    python benchmark/kernels/extend_attention_bench.py --smoke          # CPU interpreter"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

from decode_attention_bench import KV_DTYPES, add_common_args, ints, report, setup


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--extend-len", type=int, default=512, help="new tokens per request")
    p.add_argument("--cached-len", type=int, default=0, help="cached positions per request")
    p.add_argument(
        "--decode-rows", type=int, default=0, help="one-token rows after the prompts (mixed step)"
    )
    p.add_argument("--decode-cached", type=int, default=600, help="their cached positions")
    add_common_args(p, "bf16")
    p.add_argument("--block-m", type=ints, default=None, help="default: extend_tuning's")
    p.add_argument("--block-n", type=ints, default=None, help="default: extend_tuning's")
    p.add_argument("--num-warps", type=ints, default=None, help="default: extend_tuning's")
    p.add_argument("--num-stages", type=ints, default=None, help="default: extend_tuning's")
    args = p.parse_args(argv)
    if args.smoke:
        args.batch, args.extend_len, args.cached_len, args.heads, args.kv_heads = 2, 20, 9, 4, 2
        args.decode_rows, args.decode_cached = min(args.decode_rows, 3), 30
        args.head_dim, args.page_size, args.reps = 16, 4, 1
    return args


def lens(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(cached, new tokens) of each request: the prompts, then the decode rows."""
    prompts = [(args.cached_len, args.extend_len)] * args.batch
    return prompts + [(args.decode_cached, 1)] * args.decode_rows


def build(args: argparse.Namespace, device):
    """(q, k_pool, v_pool, page_table, rows, q_starts, cached_lens, extend_lens): each
    request's pages a random subset of the pool; its new tokens' K and V already stored."""
    import torch

    gen = torch.Generator().manual_seed(0)
    reqs = lens(args)
    pages = max(math.ceil((c + e) / args.page_size) for c, e in reqs)
    order = torch.randperm(pages * len(reqs), generator=gen).to(torch.int32)
    table = order.view(len(reqs), pages).contiguous()
    slots = pages * len(reqs) * args.page_size
    dtype = getattr(torch, KV_DTYPES[args.kv_dtype])
    q_dtype = torch.float16 if args.smoke else torch.bfloat16
    if args.smoke and dtype == torch.bfloat16:  # the interpreter has no bfloat16 loads
        dtype = torch.float16
    k, v = (
        torch.randn(slots, args.kv_heads, args.head_dim, generator=gen).to(dtype) for _ in range(2)
    )
    extend = torch.tensor([e for _, e in reqs], dtype=torch.int32)
    q = torch.randn(int(extend.sum()), args.heads, args.head_dim, generator=gen)
    rows = torch.arange(len(reqs), dtype=torch.int32)
    starts = (extend.cumsum(0) - extend).to(torch.int32)
    cached = torch.tensor([c for c, _ in reqs], dtype=torch.int32)
    tensors = (q.to(q_dtype), k, v, table, rows, starts, cached, extend)
    return tuple(t.to(device) for t in tensors)


def reference(q, k_pool, v_pool, table, args: argparse.Namespace, scale: float):
    """Each request's causal attention from its gathered KV in float32."""
    import torch

    outs = []
    group = args.heads // args.kv_heads
    start = 0
    for i, (cached, new) in enumerate(lens(args)):
        pos = torch.arange(cached + new, device=q.device)
        allowed = pos[None, :] <= (cached + torch.arange(new, device=q.device))[:, None]
        slot = table[i, pos // args.page_size].long() * args.page_size + pos % args.page_size
        k = k_pool[slot].float().repeat_interleave(group, dim=1)  # [n, H, D]
        v = v_pool[slot].float().repeat_interleave(group, dim=1)
        qi = q[start : start + new].float()
        start += new
        s = torch.einsum("thd,nhd->htn", qi, k) * scale
        s = s.masked_fill(~allowed[None], float("-inf"))
        outs.append(torch.einsum("htn,nhd->thd", torch.softmax(s, dim=-1), v))
    return torch.cat(outs)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.kv_dtype not in KV_DTYPES:
        print(f"error: --kv-dtype {args.kv_dtype!r}: expected one of {', '.join(KV_DTYPES)}")
        return 2
    device, peak = setup(args.smoke, 1)
    import torch

    from minisgl.kernel import triton_attention as ta

    q, k_pool, v_pool, table, rows, starts, cached, extend = build(args, device)
    scale = args.head_dim**-0.5
    ref = reference(q, k_pool, v_pool, table, args, scale)
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in lens(args))  # unmasked query-key pairs
    flops = 4 * args.head_dim * args.heads * pairs
    default = ta.extend_tuning(q)
    max_new = max(n for _, n in lens(args))
    print(f"batch {args.batch} x {args.extend_len} new tokens after {args.cached_len} cached,"
          f" {args.decode_rows} decode rows after {args.decode_cached}, {args.kv_dtype} KV;"
          f" {flops / 1e9:.1f} GFLOP; default (block_m, block_n, warps, stages) {default}")  # fmt: skip
    configs = itertools.product(
        *(given or [d] for given, d in zip((args.block_m, args.block_n, args.num_warps, args.num_stages), default))
    )  # fmt: skip
    for tuning in configs:

        def step(tuning=tuning) -> torch.Tensor:
            return ta.extend_attention(
                q, k_pool, v_pool, table, rows, starts, cached, extend, max_new, args.page_size,
                scale,
                tuning=tuning,
            )  # fmt: skip

        label = "block_m {:3d} block_n {:3d} warps {} stages {}".format(*tuning)
        report(label, step, ref, args.reps, device.type == "cuda", flops / 1e12, "TFLOP/s", peak)
    return 0


if __name__ == "__main__":
    sys.exit(main())
