"""FlashInfer's prefill attention alone on a paged KV pool, two ways (CUDA only): its paged
kernel reading the pool's pages in place, and its ragged kernel after gathering each request's
keys and values into one contiguous buffer (the gather timed with it). Each case is a chunk of
requests, `CACHED:NEW` positions each, on 16-position pages spread at random over the pool; the
rate counts the causal attention's matrix FLOPs (4 x head_dim per query-key pair that is not
masked) over the time. Both are checked against each other first.

    python benchmark/kernels/fi_prefill_bench.py                      # Qwen3-0.6B's heads
    python benchmark/kernels/fi_prefill_bench.py --case 0:16000,0:16000 --backend fa2"""

from __future__ import annotations

import argparse

import torch

CASES = [
    "0:16000,0:16000",
    "0:8000,0:8000,0:8000,0:8000",
    "8192:8192",
    "12000:4000,0:14000,0:14768",
    "0:1024," * 31 + "0:1024",
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--case", action="append", help="CACHED:NEW,... (repeatable; default: 5)")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--backend", default="fa3", help="flashinfer's: fa3, fa2 or auto")
    p.add_argument("--peak", type=float, default=989e12, help="dense bf16 FLOP/s")
    return p.parse_args(argv)


def causal_flops(pieces: list[tuple[int, int]], heads: int, dim: int) -> float:
    """4 x dim per unmasked (query, key) pair: a new token sees the prefix and itself."""
    return sum(4 * dim * heads * (new * cached + new * (new + 1) / 2) for cached, new in pieces)


def run_case(pieces: list[tuple[int, int]], args: argparse.Namespace) -> None:
    import flashinfer
    from triton.testing import do_bench

    dev, dt, ps = torch.device("cuda"), torch.bfloat16, args.page_size
    kv_lens = [c + n for c, n in pieces]
    num_pages = [-(-n // ps) for n in kv_lens]
    pool_pages = sum(num_pages) + 64
    k_pool = torch.randn(pool_pages, ps, args.kv_heads, args.head_dim, device=dev, dtype=dt)
    v_pool = torch.randn_like(k_pool)
    pages = torch.randperm(pool_pages, device=dev, dtype=torch.int32)[: sum(num_pages)]
    q = torch.randn(sum(n for _, n in pieces), args.heads, args.head_dim, device=dev, dtype=dt)
    i32 = dict(dtype=torch.int32, device=dev)
    qo_indptr = torch.tensor([0, *torch.tensor([n for _, n in pieces]).cumsum(0).tolist()], **i32)
    page_indptr = torch.tensor([0, *torch.tensor(num_pages).cumsum(0).tolist()], **i32)
    kv_indptr = torch.tensor([0, *torch.tensor(kv_lens).cumsum(0).tolist()], **i32)
    last = torch.tensor([n - (p - 1) * ps for n, p in zip(kv_lens, num_pages)], **i32)
    # each request's pool slots in order: its pages' slots, cut at its length
    slots = torch.cat([
        (pages[page_indptr[i] : page_indptr[i + 1]].long()[:, None] * ps
         + torch.arange(ps, device=dev)).flatten()[:n]
        for i, n in enumerate(kv_lens)
    ])  # fmt: skip
    shape = dict(num_qo_heads=args.heads, num_kv_heads=args.kv_heads, head_dim_qk=args.head_dim,
                 causal=True, q_data_type=dt, kv_data_type=dt)  # fmt: skip
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=args.backend)
    paged.plan(qo_indptr, page_indptr, pages, last, page_size=ps, **shape)
    ws2 = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws2, "NHD", backend=args.backend)
    ragged.plan(qo_indptr, kv_indptr, **shape)
    k_flat = k_pool.view(-1, args.kv_heads, args.head_dim)
    v_flat = v_pool.view(-1, args.kv_heads, args.head_dim)

    def run_paged() -> torch.Tensor:
        return paged.run(q, (k_pool, v_pool))

    def gather() -> tuple[torch.Tensor, torch.Tensor]:
        return k_flat.index_select(0, slots), v_flat.index_select(0, slots)

    def run_ragged() -> torch.Tensor:
        k, v = gather()
        return ragged.run(q, k, v)

    err = (run_paged().float() - run_ragged().float()).abs().max().item()
    assert err < 2e-2, f"paged and ragged differ by {err}"
    flops = causal_flops(pieces, args.heads, args.head_dim)
    times = {name: do_bench(fn, warmup=5, rep=50) for name, fn in
             (("paged", run_paged), ("gather", gather), ("gather+ragged", run_ragged))}  # fmt: skip
    label = ",".join(f"{c}:{n}" for c, n in pieces)
    cells = [f"{name} {ms * 1e3:,.0f} us" + ("" if name == "gather" else
             f" ({flops / ms / 1e9:,.0f} TFLOP/s, {flops / ms / 1e9 / args.peak * 1e12:.0%})")
             for name, ms in times.items()]  # fmt: skip
    print(f"{label}: " + "; ".join(cells) + f"; max |diff| {err:.1e}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for case in args.case or CASES:
        pieces = [tuple(int(x) for x in piece.split(":")) for piece in case.split(",")]
        run_case(pieces, args)  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
