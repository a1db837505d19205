"""The LoRA kernel (python/minisgl/ext/lora/kernel.py) at Qwen3-8B's shapes, bf16, rank 16,
4 adapter slots: us per call of the default tiles, then of each tile config swept, with PDL
and without (MINISGL_DISABLE_PDL=1). One line per (shape, tokens, config).

    python benchmark/kernels/lora_bench.py --tokens 1 --same-slot     # bench.py --single's case
    python benchmark/kernels/lora_bench.py --max-split 8,16,32 --expand-block-n 64,128,256
    python benchmark/kernels/lora_bench.py --smoke    # CPU, Triton interpreter: checks, no timing

Timing: a CUDA graph of --calls launches (36 layers x 4 projections), each call on its own copy
of the adapters' weights (as each layer has its own), replayed and timed with CUDA events.
Token t uses slot t % 4 + 1, or slot 1 for all with --same-slot. Every config is checked
against the torch reference (lora_reference) first."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "python"))  # after PYTHONPATH: an A/B may set another tree

# name -> (output rows of each merged part, input features): Qwen3-8B at TP 1
SHAPES = {
    "qkv": ([4096, 1024, 1024], 4096),
    "o": ([4096], 4096),
    "gate_up": ([12288, 12288], 4096),
    "down": ([4096], 12288),
}
from decode_attention_bench import time_us  # noqa: E402  (this directory)

SWEPT = ("block_k", "max_split", "shrink_warps", "expand_block_n", "wide_block_n", "expand_warps")


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def configs(args: argparse.Namespace) -> list[Any]:
    """The default tiles first, then every combination of the swept values (0: the default)."""
    from minisgl.ext.lora.kernel import TILES

    values = [[v or getattr(TILES, f) for v in ints(getattr(args, f))] for f in SWEPT]
    out = [TILES] + [
        dataclasses.replace(TILES, **dict(zip(SWEPT, c))) for c in itertools.product(*values)
    ]
    return list(dict.fromkeys(out))


def bench_shape(name: str, tokens: int, args: argparse.Namespace) -> None:
    import torch

    from minisgl.ext.lora import kernel
    from minisgl.ext.lora.layers import lora_reference
    from minisgl.ext.lora.weights import ProjectionLora

    sizes, fan_in = SHAPES[name]
    bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
    dev = torch.device("cpu" if args.smoke else "cuda")
    dtype, gen = torch.float32 if args.smoke else torch.bfloat16, torch.Generator(device=dev)
    gen.manual_seed(tokens)
    r, s = args.rank, args.slots

    def weights() -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.randn(s + 1, len(sizes) * r, fan_in, device=dev, generator=gen) / fan_in**0.5
        b = torch.randn(s + 1, bounds[-1], r, device=dev, generator=gen) / r**0.5
        a[0], b[0] = 0, 0
        return a.to(dtype), b.to(dtype)

    copies = [weights() for _ in range(args.calls)]
    offsets = torch.tensor(bounds, dtype=torch.int32, device=dev)
    x = torch.randn(tokens, fan_in, device=dev, generator=gen).to(dtype)
    y = torch.randn(tokens, bounds[-1], device=dev, generator=gen).to(dtype)
    ids = [1] * tokens if args.same_slot else [t % s + 1 for t in range(tokens)]
    slots = torch.tensor(ids, dtype=torch.int32, device=dev)
    proj = ProjectionLora(None, (), r, *copies[0], bounds, offsets)  # type: ignore[arg-type]
    expected = lora_reference(y, x, slots, proj)
    for tiles, pdl in itertools.product(configs(args), (False,) if args.smoke else (True, False)):
        os.environ["MINISGL_DISABLE_PDL"] = "" if pdl else "1"
        label = " ".join(f"{f}={getattr(tiles, f)}" for f in SWEPT) + f" pdl={int(pdl)}"
        label += " (default)" if tiles == kernel.TILES else ""
        out = kernel.lora_add(y.clone(), x, slots, *copies[0], offsets, bounds, tiles)
        if not torch.allclose(out.float(), expected.float(), atol=3e-2, rtol=2e-2):
            print(f"{name:8s} tokens={tokens:3d} {label}: WRONG (against lora_reference)")
            continue
        if args.smoke:
            print(f"{name:8s} tokens={tokens:3d} {label}: checked", flush=True)
            continue

        def call(i: int, out: Any = out, tiles: Any = tiles) -> object:  # y stays as it was
            return kernel.lora_add(out, x, slots, *copies[i], offsets, bounds, tiles)

        # one CUDA graph of every call (each layer its own weights), replayed: us per call
        us = time_us(lambda: [call(i) for i in range(args.calls)], args.reps, True) / args.calls
        print(f"{name:8s} tokens={tokens:3d} {us:7.2f} us/call  {label}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), help="of " + ", ".join(SHAPES))
    p.add_argument("--tokens", default="1,8", help="batch sizes")
    for field in SWEPT:
        p.add_argument("--" + field.replace("_", "-"), default="0", help="values (0: default)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--slots", type=int, default=4, help="adapter slots (besides slot 0)")
    p.add_argument("--same-slot", action="store_true", help="every token on slot 1")
    p.add_argument("--calls", type=int, default=36 * 4, help="launches per CUDA graph")
    p.add_argument("--reps", type=int, default=20, help="graph replays timed")
    p.add_argument("--smoke", action="store_true", help="CPU, interpreter: check, no timing")
    args = p.parse_args()
    names = [n.strip() for n in args.shapes.split(",") if n.strip()]
    if unknown := [n for n in names if n not in SHAPES]:
        p.error(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    if min(args.rank, args.slots, args.calls, args.reps, *ints(args.tokens)) < 1:
        p.error("--rank, --slots, --calls, --reps and --tokens must be at least 1")
    if args.smoke:  # before anything imports triton
        os.environ["TRITON_INTERPRET"] = "1"
        args.calls = 1
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("lora_bench.py times CUDA kernels: no CUDA device here (--smoke checks)")
    device = "--smoke (CPU, float32)" if args.smoke else torch.cuda.get_device_name() + ", bf16"
    print(f"{device}: rank {args.rank}, {args.slots} slots, {args.calls} calls per graph")
    for name in names:
        for tokens in ints(args.tokens):
            bench_shape(name, tokens, args)


if __name__ == "__main__":
    main()
