"""The small-batch GEMV (python/minisgl/kernel/gemv.py) against F.linear at a model's decode
shapes (default Qwen3-0.6B: qkv, o, gate_up + SiLU, down, LM head) for M = 1, 2, 4, 8. Each
(shape, M) times F.linear (gate_up: F.linear + the fused SiLU-and-mul, what the model runs
without the GEMV), the config the engine uses now (`CONFIGS` entry or `heuristic`) and every
candidate config, each checked against F.linear first; then the best config per (shape, M) as
`CONFIGS` lines to paste into kernel/gemv.py, and the linear layers' time per decode step.

    python benchmark/kernels/gemv_bench.py                  # about 1-2 min on an H100
    python benchmark/kernels/gemv_bench.py --m 1 --shapes qkv,lm_head --all
    python benchmark/kernels/gemv_bench.py --config benchmark/qwen3-8b
    python benchmark/kernels/gemv_bench.py --smoke          # CPU, Triton interpreter, tiny

Timing: a CUDA graph of one call per copy of the weight, enough copies (>= 256 MiB) that no
call finds its weight in L2, as in a model whose layers each have their own; replayed, timed
with CUDA events. GB/s counts the weight bytes only; the fraction is of the data-sheet
bandwidth (GPU_PEAKS in benchmark/offline/bench.py)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))


def model_shapes(config_dir: str) -> dict[str, tuple[int, int, bool, int]]:
    """name -> (rows of W, K, fused SiLU, uses per decode step) of a Llama-style config."""
    with open(os.path.join(config_dir, "config.json")) as f:
        c = json.load(f)
    hidden, layers = c["hidden_size"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or hidden // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c.get("num_key_value_heads", 1) * head_dim
    return {
        "qkv": (q + 2 * kv, hidden, False, layers),
        "o": (hidden, q, False, layers),
        "gate_up": (2 * c["intermediate_size"], hidden, True, layers),
        "down": (hidden, c["intermediate_size"], False, layers),
        "lm_head": (c["vocab_size"], hidden, False, 1),
    }


def candidates(
    rows: int,
    k: int,
    m: int,
    silu: bool,
    smoke: bool = False,
    fma_stages: tuple = (1,),
    wide: bool = False,
) -> list:
    """Configs worth timing for a weight [rows, K] at M rows: the heuristic's; FMA tiles of
    2048, 4096 and 8192 accumulators (8 warps for the largest) with K split as the heuristic
    would and unsplit, at each of `fma_stages` where K takes several tiles; tensor-core tiles
    likewise. `wide`: also K tiles of 2048, 16384 accumulators and 8 warps for 4096 (more
    bytes in flight a program, for GPUs of more bandwidth)."""
    from minisgl.kernel.gemv import GemvConfig, block_m, heuristic, split_for

    bm, tiles, sms = block_m(m), 2 if silu else 1, 132
    if smoke:  # the interpreter: two small configs
        return [GemvConfig(8, 32, 2), GemvConfig(16, 32, 1, dot=True)]
    out = [heuristic(rows, k, bm, sms, silu)]

    def splits(cfg: GemvConfig) -> list[GemvConfig]:
        split = split_for(-(-rows // tiles // cfg.block_n), k, cfg.block_k, sms)
        return [replace(cfg, split_k=s) for s in sorted({split, 1})]

    shapes = ((2048, 4), (4096, 4), (8192, 8))
    if wide:
        shapes += ((4096, 8), (16384, 8))
    for block_k in (256, 512, 1024, 2048) if wide else (256, 512, 1024):
        for product, warps in shapes:
            block_n = product // (bm * block_k * tiles)
            if block_k <= k and 1 <= block_n <= 64:
                for stages in fma_stages if block_k < k else (1,):
                    out += splits(GemvConfig(block_n, block_k, num_warps=warps, num_stages=stages))
    for block_n, block_k in ((16, 128), (16, 256), (32, 128), (32, 256), (64, 64), (64, 128)):
        if block_k <= max(16, k):
            out += splits(GemvConfig(block_n, block_k, num_stages=3, dot=True))
    return list(dict.fromkeys(out))  # unique, in order


def time_us(fn: Callable[[int], object], copies: int, cuda: bool) -> float:
    """Mean time of fn(i) over the weight copies i."""
    import torch

    for i in range(copies):  # compile, warm up
        fn(i)
    if not cuda:
        start = time.perf_counter()
        for i in range(copies):
            fn(i)
        return (time.perf_counter() - start) / copies * 1e6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn(i)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 10
    begin.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) * 1e3 / (reps * copies)


def bench_case(
    name: str, rows: int, k: int, silu: bool, m: int, ws: list, args, rate: Callable
) -> tuple[float, float, object]:
    """One (shape, M): prints the timings; returns (F.linear us, best GEMV us, best config)."""
    import torch
    import torch.nn.functional as F
    from triton.runtime.errors import OutOfResources

    from minisgl.kernel import gemv
    from minisgl.layers.activation import silu_and_mul

    cuda, w0 = not args.smoke, ws[0]
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(w0.device, w0.dtype)
    op = gemv.gemv_silu_and_mul if silu else gemv.gemv

    def baseline(i: int) -> object:
        y = F.linear(x, ws[i])
        return silu_and_mul(y) if silu else y

    ref = baseline(0).float()
    scale = max(ref.abs().max().item(), 1.0)
    base = time_us(baseline, len(ws), cuda)
    now = time_us(lambda i: op(x, ws[i]), len(ws), cuda)
    results = []
    for cfg in candidates(rows, k, m, silu, args.smoke, args.fma_stages, args.wide):
        try:
            err = (op(x, w0, config=cfg).float() - ref).abs().max().item()
        except OutOfResources:  # e.g. 64 rows x 2 tiles x 256 K of 3 stages: 256 KiB of smem
            print(f"  SKIP  {cfg}: more shared memory than the GPU has")
            continue
        if err > 3e-2 * scale:
            print(f"  WRONG {cfg}: max error {err:.3g}")
            continue
        results.append((time_us(lambda i, cfg=cfg: op(x, ws[i], config=cfg), len(ws), cuda), cfg))
    results.sort(key=lambda r: r[0])
    nbytes = w0.numel() * w0.element_size()
    print(f"{name} {rows}x{k} M={m}: F.linear {rate(nbytes, base)}")
    print(f"  now   {rate(nbytes, now)}  {gemv.config_for(rows, k, m, w0.device, silu)}")
    for us, cfg in results if args.all else results[:3]:
        print(f"  cand  {rate(nbytes, us)}  {cfg}")
    if not results:
        return base, now, None
    us, cfg = results[0]
    print(f"  best  {rate(nbytes, us)}  {us / base:.2f}x F.linear's time")
    return base, min(us, now), cfg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default=os.path.join(ROOT, "benchmark", "qwen3-0.6b"))
    p.add_argument("--shapes", default="qkv,o,gate_up,down,lm_head")
    p.add_argument("--m", help="rows of x (batch sizes), at most 64; default 1,2,4,8 (smoke: 1,3)")
    p.add_argument("--all", action="store_true", help="print every candidate, not the top 3")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton interpreter, tiny shapes")
    p.add_argument(
        "--fma-stages", default="1", help="num_stages for the FMA candidates (e.g. 1,2,3)"
    )
    p.add_argument("--wide", action="store_true", help="also K tiles of 2048 and 8-warp FMA tiles")
    args = p.parse_args()
    args.fma_stages = tuple(int(v) for v in args.fma_stages.split(","))
    if args.smoke:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from bench import GPU_PEAKS

    from minisgl.kernel import GEMV_KERNEL_MAX_M
    from minisgl.kernel.gemv import block_m

    cuda = not args.smoke
    if cuda and not torch.cuda.is_available():
        sys.exit("gemv_bench.py needs a CUDA GPU (or --smoke for the CPU interpreter)")
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    gpu = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    peak = next((bw for name, (bw, _) in GPU_PEAKS.items() if name in gpu), None)
    ms = [int(v) for v in (args.m or ("1,3" if args.smoke else "1,2,4,8")).split(",")]
    if any(not 1 <= m <= GEMV_KERNEL_MAX_M for m in ms):
        sys.exit(f"--m {args.m}: each M must be in 1..{GEMV_KERNEL_MAX_M}")
    all_shapes = (
        {"tiny": (40, 48, False, 1), "tiny_silu": (48, 40, True, 1)}
        if args.smoke
        else model_shapes(args.config)
    )
    names = list(all_shapes) if args.smoke else args.shapes.split(",")
    if unknown := [n for n in names if n not in all_shapes]:
        sys.exit(f"--shapes: unknown {unknown}; choose from {list(all_shapes)}")
    print(f"{gpu}, {dtype}, peak {peak / 1e9:.0f} GB/s" if peak else f"{gpu}, {dtype}")

    def rate(nbytes: int, us: float) -> str:
        frac = f" {nbytes / us / 1e6 / peak:4.0%}" if peak else ""
        return f"{us:8.2f} us {nbytes / us / 1e3:6.0f} GB/s{frac}"

    best_lines, step = [], {m: [0.0, 0.0] for m in ms}  # M -> [F.linear, GEMV] us per step
    for name in names:
        rows, k, silu, uses = all_shapes[name]
        # enough copies that no call finds its weight in L2 (>= 256 MiB in all)
        copies = max(1, -(-(256 << 20) // (rows * k * dtype.itemsize))) if cuda else 1
        w = (torch.randn(rows, k, generator=torch.Generator().manual_seed(0)) / k**0.5).to(
            device, dtype
        )
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        for m in ms:
            base, fast, cfg = bench_case(name, rows, k, silu, m, ws, args, rate)
            step[m][0] += uses * base
            step[m][1] += uses * fast
            if cfg is not None:
                best_lines.append(f"    ({rows}, {k}, {block_m(m)}): {cfg},")
    print("\nCONFIGS entries (kernel/gemv.py), best measured:")
    print("\n".join(best_lines))
    if set(names) == set(all_shapes):
        print("\nlinear layers per decode step (every shape x its uses per step):")
        for m, (base, fast) in step.items():
            print(f"  M={m}: F.linear {base:8.1f} us, GEMV {fast:8.1f} us")


if __name__ == "__main__":
    main()
