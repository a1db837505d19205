"""The host time of F.linear at a model's shapes (default Qwen3-0.6B: qkv, o, gate_up, down) on
its first call with a new number of rows M, against a second call with the same M. On CUDA,
cuBLAS picks a kernel per (M, N, K) and, with lazy module loading (CUDA's default), loads a kernel
at its first use: on an H200 that first call took 3.2-4.5 ms of host time, the same M again
0.02-0.1 ms (docs/benchmarks.md, session 33). An eager prefill step with a new token count can
meet such loads, with the GPU idle behind them once the launch queue has drained.

    python benchmark/kernels/gemm_first_call_bench.py               # GPU
    CUDA_MODULE_LOADING=EAGER python benchmark/kernels/gemm_first_call_bench.py
    CUBLASLT_HEURISTICS_CACHE_CAPACITY=0 python ...  # the "again" column is the heuristic alone
    python benchmark/kernels/gemm_first_call_bench.py --device cpu --ms 4   # smoke run

Each call is timed on the host between two device synchronizations, so the figure is the host's
own (the launch, cuBLAS's choice and any load), not the kernel's."""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.nn.functional as F


def linear_shapes(config_dir: str) -> dict[str, tuple[int, int]]:
    """(out_features, in_features) of one layer's dense projections, from a config.json."""
    with open(os.path.join(config_dir, "config.json")) as f:
        c = json.load(f)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv, hidden = (
        c["num_attention_heads"] * head_dim,
        c["num_key_value_heads"] * head_dim,
        c["hidden_size"],
    )
    inter = c["intermediate_size"]
    return {
        "qkv": (q + 2 * kv, hidden),
        "o": (hidden, q),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="benchmark/qwen3-0.6b", help="model directory")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ms", type=int, default=12, help="how many new row counts per shape")
    p.add_argument("--max-rows", type=int, default=8192, help="the largest row count drawn")
    args = p.parse_args()
    dtype = torch.bfloat16 if args.device != "cpu" else torch.float32
    shapes = linear_shapes(args.config)
    weights = {
        k: torch.randn(n, k_, device=args.device, dtype=dtype) for k, (n, k_) in shapes.items()
    }
    width = max(k_ for _, k_ in shapes.values())
    x = torch.randn(args.max_rows, width, device=args.device, dtype=dtype)
    host_ms(x, weights["qkv"], 1)  # the context and cuBLAS's handle, outside the figures
    rng = random.Random(0)
    for name, weight in weights.items():
        rows = [rng.randrange(300, args.max_rows) for _ in range(args.ms)]
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
