"""The host time of F.linear at a model's shapes (default Qwen3-0.6B: qkv, o, gate_up, down, and
the LM head up to 512 rows, a step's sampled ones) on its first call with a new number of rows
M, against a second call with the same M. On an H200 the first call took 3.2-4.5 ms of host
time for most new M, the same M again 0.02-0.1 ms, and with cuBLASLt's heuristic cache off a
repeat 0.27 ms (docs/benchmarks.md, session 33): the rest is most likely cuBLAS loading the
kernel it picked (CUDA's lazy module loading; an inference, not confirmed). An eager step with
a new token count can meet such costs, with the GPU idle behind them once the launch queue has
drained.

    python benchmark/kernels/gemm_first_call_bench.py               # GPU
    CUDA_MODULE_LOADING=EAGER python benchmark/kernels/gemm_first_call_bench.py
    CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 python ...  # the "again" column is the heuristic alone
    python benchmark/kernels/gemm_first_call_bench.py --kernels 1  # the kernel of every M
    python benchmark/kernels/gemm_first_call_bench.py --after-capture 184,200,248
    python benchmark/kernels/gemm_first_call_bench.py --device cpu --ms 4   # smoke run

`--kernels STEP` instead names the kernels cuBLAS runs for every STEP-th M up to --max-rows
(under torch's profiler), as ranges of M per kernel, and how many of those kernels a warm-up
over every 8th, 16th, ... M would have loaded. `--after-capture ROWS,...` first captures the
LM head in CUDA graphs at those sizes as the engine does, then times its eager first calls at
each size and one row less: whether the engine's capture spares the eager steps that cost.

Each call is timed on the host between two device synchronizations, so the figure is the host's
own (the launch, cuBLAS's choice and any load), not the kernel's."""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gemv_bench import model_shapes  # noqa: E402

LM_HEAD_ROWS = 512  # the LM head sees a step's sampled rows: its requests, not its tokens


def linear_shapes(config_dir: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one layer's dense projections and the LM head, from a
    config.json (gemv_bench's shapes without their decode-step counts)."""
    return {name: (n, k) for name, (n, k, _, _) in model_shapes(config_dir).items()}


def host_ms(x: torch.Tensor, weight: torch.Tensor, rows: int) -> float:
    """Milliseconds of host time of one F.linear over the first `rows` rows of `x`."""
    sync = torch.cuda.synchronize if x.is_cuda else lambda: None
    a = x[:rows, : weight.shape[1]]
    sync()
    start = time.perf_counter()
    F.linear(a, weight)
    elapsed = (time.perf_counter() - start) * 1e3
    sync()
    return elapsed


def kernels_by_rows(x: torch.Tensor, weight: torch.Tensor, rows: list[int]) -> dict[int, str]:
    """The device kernels (on CPU: the operators) one F.linear runs at each row count."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if x.is_cuda else [])
    with profile(activities=activities) as prof:
        for m in rows:
            with record_function(f"rows={m}"):
                F.linear(x[:m, : weight.shape[1]], weight)
    found: dict[int, str] = {}

    def launched(event: Any) -> list[str]:
        names = [k.name for k in event.kernels if "memset" not in k.name.lower()]
        if not x.is_cuda and event.name in ("aten::mm", "aten::addmm", "aten::bmm"):
            names.append(event.name)  # the CPU smoke run: the operator
        return names + [n for child in event.cpu_children for n in launched(child)]

    for event in prof.events():
        if event.name.startswith("rows="):
            found[int(event.name[5:])] = " + ".join(launched(event)) or "?"
    return found


def rows_of(name: str, max_rows: int) -> int:
    """The most rows a shape meets: the LM head only the sampled ones (at most a batch)."""
    return min(max_rows, LM_HEAD_ROWS) if name == "lm_head" else max_rows


def kernel_ranges(found: dict[int, str]) -> list[tuple[int, int, str]]:
    """(first M, last M, kernels) of each run of consecutive row counts with the same kernels."""
    ranges: list[tuple[int, int, str]] = []
    for m in sorted(found):
        if ranges and ranges[-1][2] == found[m]:
            ranges[-1] = (ranges[-1][0], m, found[m])
        else:
            ranges.append((m, m, found[m]))
    return ranges


def grid_misses(found: dict[int, str], step: int) -> set[str]:
    """The kernels that a warm-up at M = 1, step, 2 step, ... would not have met."""
    met = {found[m] for m in found if m == 1 or m % step == 0}
    return set(found.values()) - met


def report_kernels(x: torch.Tensor, weights: dict[str, torch.Tensor], step: int) -> None:
    for name, weight in weights.items():
        top = rows_of(name, x.shape[0])
        found = kernels_by_rows(x, weight, list(range(1, top + 1, step)))
        kinds = set(found.values())
        print(f"{name} {tuple(weight.shape)}: {len(kinds)} kernels over M = 1..{top}")
        for first, last, kernels in kernel_ranges(found):
            print(f"   M {first:5d}-{last:5d}  {kernels[:110]}")
        for grid in (8, 16, 32, 64, 128):
            if grid > step:
                print(f"   a warm-up every {grid} rows misses {len(grid_misses(found, grid))}")


def capture_like_the_engine(x: torch.Tensor, weight: torch.Tensor, rows: int) -> None:
    """A CUDA graph of F.linear at `rows`, captured as engine/graph.py captures a decode step:
    an eager run on a side stream first, then the capture."""
    a = x[:rows, : weight.shape[1]]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        F.linear(a, weight)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(torch.cuda.CUDAGraph()):
        F.linear(a, weight)
    torch.cuda.synchronize()


def report_after_capture(x: torch.Tensor, weight: torch.Tensor, sizes: list[int]) -> None:
    """The LM head's eager first calls at each captured size and one row less (the rows of a
    mixed step), after graphs at those sizes: whether capture already did what a first call
    costs (session 33's open doubt)."""
    for rows in sizes:
        capture_like_the_engine(x, weight, rows)
    for rows in sizes:
        at, below = host_ms(x, weight, rows), host_ms(x, weight, rows - 1)
        print(f"lm_head after capture at {rows}: eager first call at {rows} {at:.2f} ms, "
              f"at {rows - 1} {below:.2f} ms")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="benchmark/qwen3-0.6b", help="model directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ms", type=int, default=12, help="how many new row counts per shape")
    p.add_argument("--max-rows", type=int, default=8192, help="the largest row count drawn")
    p.add_argument("--kernels", type=int, metavar="STEP", help="name the kernel of every STEP-th M")
    p.add_argument(
        "--after-capture",
        metavar="ROWS,...",
        help="CUDA only: capture the LM head at these sizes first, then time its eager calls",
    )
    args = p.parse_args()
    if args.after_capture and args.device == "cpu":
        p.error("--after-capture needs CUDA graphs: --device cuda")
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    shapes = linear_shapes(args.config)
    weights = {
        k: torch.randn(n, k_, device=args.device, dtype=dtype) for k, (n, k_) in shapes.items()
    }
    width = max(k_ for _, k_ in shapes.values())
    x = torch.randn(args.max_rows, width, device=args.device, dtype=dtype)
    host_ms(x, weights["qkv"], 1)  # the context and cuBLAS's handle, outside the figures
    if args.after_capture:
        sizes = [int(v) for v in args.after_capture.split(",")]
        report_after_capture(x, weights["lm_head"], sizes)
        return
    if args.kernels:
        report_kernels(x, weights, args.kernels)
        return
    rng = random.Random(0)
    for name, weight in weights.items():
        top = rows_of(name, args.max_rows)
        rows = [rng.randrange(min(300, top // 2), top) for _ in range(args.ms)]
        first = [host_ms(x, weight, m) for m in rows]
        again = [host_ms(x, weight, m) for m in rows]
        print(
            f"{name:8s} {tuple(weight.shape)} first call per new M (ms): "
            + " ".join(f"{v:.2f}" for v in first)
        )
        print(
            f"{name:8s} {tuple(weight.shape)} the same M again (ms):      "
            + " ".join(f"{v:.2f}" for v in again)
        )


if __name__ == "__main__":
    main()
