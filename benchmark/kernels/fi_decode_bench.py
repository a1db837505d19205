"""FlashInfer's paged decode attention against minisgl's Triton split kernel (CUDA only), one
batch at the offline benchmark's decode shapes: requests of random KV lengths on pages spread
over the pool, bf16 or fp8 KV. FlashInfer's kernel for a group of fewer than 4 query heads per kv
head (Qwen3-0.6B: 2) runs on CUDA cores, with no tensor-core tile padded to 16 query rows, which
is where the Triton kernel spends its work per byte on an fp8 pool (docs/benchmarks.md). Both
are checked against each other first, then timed as CUDA-graph replays; the rate counts the K and
V bytes the batch must read.

    python benchmark/kernels/fi_decode_bench.py                       # bf16 and fp8
    python benchmark/kernels/fi_decode_bench.py --kv-dtype fp8_e4m3 --batch 64,256"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "python"))

KV_DTYPES = {"bf16": torch.bfloat16, "fp8_e4m3": torch.float8_e4m3fn}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", default="16,64,256", help="requests, comma-separated")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1800)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3", help=f"of {', '.join(KV_DTYPES)}")
    p.add_argument("--peak", type=float, default=4.8e12, help="memory bytes/s (H200)")
    return p.parse_args(argv)


def graphed(fn):
    """fn captured in a CUDA graph (as the engine runs a decode step): its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled, allocations made, outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def run_case(batch: int, kv_dtype: torch.dtype, args: argparse.Namespace) -> None:
    import flashinfer
    from triton.testing import do_bench

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
        ms = do_bench(graphed(fn), warmup=10, rep=100)
        rate = nbytes / ms / 1e9
        cells.append(f"{name} {ms * 1e3:,.1f} us ({rate:.2f} TB/s, {rate * 1e12 / args.peak:.0%})")
    verdict = "" if err < 5e-2 else "  DIFFER"
    kind = str(kv_dtype).removeprefix("torch.")
    print(f"{kind} {batch} requests: " + "; ".join(cells) + f"; max |diff| {err:.1e}{verdict}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for name in args.kv_dtype.split(","):
        for batch in (int(b) for b in args.batch.split(",")):
            run_case(batch, KV_DTYPES[name], args)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
