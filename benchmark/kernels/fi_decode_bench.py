"""FlashInfer's paged decode attention against minisgl's Triton split kernel (CUDA only), one batch
at the offline benchmark's decode shapes: requests of random KV lengths on pages spread over the
pool, bf16 or fp8 KV. FlashInfer's kernel for a group of fewer than 4 query heads per kv head
(Qwen3-0.6B: 2) runs on CUDA cores, with no tensor-core tile padded to 16 query rows, which is
where the Triton kernel spends its work per byte on an fp8 pool (docs/benchmarks.md). Both are
checked against the float32 reference first, then timed as CUDA-graph replays; the rate counts
the K and V bytes the batch must read (`decode_attention_bench.py`'s options and timing).

    python benchmark/kernels/fi_decode_bench.py                       # bf16 and fp8
    python benchmark/kernels/fi_decode_bench.py --kv-dtype fp8_e4m3 --batch 64,256"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_attention_bench as single  # noqa: E402  (its options, batch and timing)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--batch", dest="batches", default="16,64,256", help="requests, comma-separated")
    p.add_argument("--min-len", type=int, default=300)
    p.add_argument("--max-len", type=int, default=1800)
    single.add_common_args(p, "bf16,fp8_e4m3")
    args = p.parse_args(argv)
    if args.smoke:
        p.error("--smoke: flashinfer runs on CUDA only")
    return args


def run_case(args: argparse.Namespace, kv_dtype: str, peak: float | None) -> None:
    """One batch (args.batch requests) on `build`'s pool and page table, both kernels."""
    import flashinfer

    from minisgl.kernel import triton_attention as ta

    dev, ps, scale = torch.device("cuda"), args.page_size, args.head_dim**-0.5
    q, k_flat, v_flat, table, rows, kv_lens, lengths = single.build(args, kv_dtype, dev)
    # flashinfer reads the same pages: each request's page-table row up to its page count
    num_pages = (lengths + ps - 1) // ps
    i32 = dict(dtype=torch.int32, device=dev)
    page_indptr = torch.tensor([0, *num_pages.cumsum(0).tolist()], **i32)
    pages = torch.cat([table[i, :n] for i, n in enumerate(num_pages.tolist())])
    last = (lengths - (num_pages - 1) * ps).to(**i32)
    shape = (-1, ps, args.kv_heads, args.head_dim)
    paged = (k_flat.view(shape), v_flat.view(shape))
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=False)
    fi.plan(
        page_indptr, pages, last, args.heads, args.kv_heads, args.head_dim, ps,
        sm_scale=scale, q_data_type=q.dtype, kv_data_type=k_flat.dtype,
    )  # fmt: skip
    order = torch.argsort(kv_lens, descending=True, stable=True).to(torch.int32)
    splits = ta.decode_splits(args.batch, args.kv_heads, ta.num_sms(dev))

    def run_fi() -> torch.Tensor:
        return fi.run(q, paged)

    def run_triton() -> torch.Tensor:
        return ta.decode_attention(
            q, k_flat, v_flat, table, rows, kv_lens, splits, ps, scale, order=order
        )

    ref = single.reference(q, k_flat, v_flat, table, lengths, ps, scale)
    nbytes = int(lengths.sum()) * args.kv_heads * args.head_dim * 2 * k_flat.element_size()
    cells = []
    for name, fn in (("flashinfer", run_fi), ("triton", run_triton)):
        err = (fn().float() - ref).abs().max().item()
        us = single.time_us(fn, args.reps, cuda=True)  # CUDA-graph replays
        rate = nbytes / us / 1e6
        share = "" if peak is None else f", {rate / peak:.0%}"
        wrong = "" if err < 5e-2 else " WRONG"
        cells.append(f"{name} {us:,.1f} us ({rate:.2f} TB/s{share}), max error {err:.1e}{wrong}")
    print(f"{kv_dtype} {args.batch} requests: " + "; ".join(cells))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("error: flashinfer's decode runs on CUDA only")
        return 2
    _, peak = single.setup(False, 0)
    for name in args.kv_dtype.split(","):
        if name not in single.KV_DTYPES:
            print(f"error: --kv-dtype {name!r}: expected one of {', '.join(single.KV_DTYPES)}")
            return 2
        for batch in args.batches.split(","):
            run_case(argparse.Namespace(**{**vars(args), "batch": int(batch)}), name, peak)
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
