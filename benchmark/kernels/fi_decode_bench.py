"""FlashInfer's paged decode attention against minisgl's Triton split kernel (CUDA only), one
batch at the offline benchmark's decode shapes: requests of random KV lengths on pages spread
over the pool, bf16 or fp8 KV. FlashInfer's kernel for a group of fewer than 4 query heads per kv
head (Qwen3-0.6B: 2) runs on CUDA cores, with no tensor-core tile padded to 16 query rows, which
is where the Triton kernel spends its work per byte on an fp8 pool (docs/benchmarks.md). Both
are checked against each other first, then timed as CUDA-graph replays; the rate counts the K and
V bytes the batch must read (`decode_attention_bench.py`'s options and timing).

    python benchmark/kernels/fi_decode_bench.py                       # bf16 and fp8
    python benchmark/kernels/fi_decode_bench.py --kv-dtype fp8_e4m3 --batch 64,256"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode_attention_bench import KV_DTYPES, add_common_args, setup, time_us  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="16,64,256", help="requests, comma-separated")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1800)
    add_common_args(p, "bf16,fp8_e4m3")
    args = p.parse_args(argv)
    if args.smoke:
        p.error("--smoke: flashinfer runs on CUDA only")
    return args


def run_case(
    batch: int, kv_dtype: torch.dtype, args: argparse.Namespace, peak: float | None
) -> None:
    import flashinfer

    from minisgl.kernel import triton_attention as ta

    dev, ps, gen = torch.device("cuda"), args.page_size, torch.Generator().manual_seed(batch)
    lens = torch.randint(args.min_len, args.max_len + 1, (batch,), generator=gen)
    num_pages = (lens + ps - 1) // ps
    pool_pages = int(num_pages.sum()) + 64
    shape = (pool_pages, ps, args.kv_heads, args.head_dim)
    k_pool, v_pool = (torch.randn(shape, device=dev).to(kv_dtype) for _ in "kv")
    pages = torch.randperm(pool_pages, device=dev, dtype=torch.int32)[: int(num_pages.sum())]
    i32 = dict(dtype=torch.int32, device=dev)
    page_indptr = torch.tensor([0, *num_pages.cumsum(0).tolist()], **i32)
    last = torch.tensor((lens - (num_pages - 1) * ps).tolist(), **i32)
    q = torch.randn(batch, args.heads, args.head_dim, device=dev, dtype=torch.bfloat16)
    scale = args.head_dim**-0.5

    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
    fi.plan(
        page_indptr, pages, last, args.heads, args.kv_heads, args.head_dim, ps,
        sm_scale=scale, q_data_type=torch.bfloat16, kv_data_type=kv_dtype,
    )  # fmt: skip

    # the Triton kernel reads the same pages through a page table, a row per request
    table = torch.zeros(batch, int(num_pages.max()), **i32)
    for i in range(batch):
        table[i, : num_pages[i]] = pages[page_indptr[i] : page_indptr[i + 1]]
    rows, kv_lens = torch.arange(batch, **i32), lens.to(**i32)
    order = torch.argsort(kv_lens, descending=True, stable=True).to(torch.int32)
    splits = ta.decode_splits(batch, args.kv_heads, ta.num_sms(dev))
    k_flat = k_pool.view(-1, args.kv_heads, args.head_dim)
    v_flat = v_pool.view(-1, args.kv_heads, args.head_dim)

    def run_fi() -> torch.Tensor:
        return fi.run(q, (k_pool, v_pool))

    def run_triton() -> torch.Tensor:
        return ta.decode_attention(
            q, k_flat, v_flat, table, rows, kv_lens, splits, ps, scale, order=order
        )

    err = (run_fi().float() - run_triton().float()).abs().max().item()
    nbytes = int(lens.sum()) * args.kv_heads * args.head_dim * 2 * k_pool.element_size()
    cells = []
    for name, fn in (("flashinfer", run_fi), ("triton", run_triton)):
        us = time_us(fn, args.reps, cuda=True)  # CUDA-graph replays
        rate = nbytes / us / 1e6
        share = "" if peak is None else f", {rate / peak:.0%}"
        cells.append(f"{name} {us:,.1f} us ({rate:.2f} TB/s{share})")
    verdict = "" if err < 5e-2 else "  DIFFER"
    kind = str(kv_dtype).removeprefix("torch.")
    print(f"{kind} {batch} requests: " + "; ".join(cells) + f"; max |diff| {err:.1e}{verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: flashinfer's decode runs on CUDA only")
        return 2
    _, peak = setup(False, 0)
    for name in args.kv_dtype.split(","):
        if name not in KV_DTYPES:
            print(f"error: --kv-dtype {name!r}: expected one of {', '.join(KV_DTYPES)}")
            return 2
        for batch in (int(b) for b in args.batch.split(",")):
            run_case(batch, getattr(torch, KV_DTYPES[name]), args, peak)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
