"""minisgl's CPU kernel (python/minisgl/ext/cpu/qdot.cpp) at decode: one row through `--layers`
copies of a GGUF kind's projection (together larger than L3, so the codes stream from DRAM),
two layouts of its scales timed in turn (ABBA) in one process:
- Q4_0, Q8_0 (and Q6_K with `--fp16-rows`): float16 rows with and without the mn row (these
  kinds go without it: half a bit a weight less to read), the same bits;
- K-quants (Q4_K, Q5_K, Q6_K): the file's factors (per 256 weights float16 d, per 32 int8 sc)
  against their products rounded to float16 rows (5/8 of a bit a weight against 1 with mn).
Prints each variant's median and best time a layer and its GB/s. Needs the kernel (AVX512-VNNI,
AVX-VNNI or AVX2, and g++).

    python benchmark/kernels/qdot_bench.py --kind Q6_K --out 32768 --cols 1024  # an LM head
    python benchmark/kernels/qdot_bench.py --kind Q4_K --out 11264 --cols 1024  # gate+up
    python benchmark/kernels/qdot_bench.py --kind Q8_0 --out 8192 --cols 2048
    python benchmark/kernels/qdot_bench.py --kind Q4_0 --out 16384 --cols 2048"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))


def layers(kind: str, out: int, cols: int, seed: int, fp16_rows: bool) -> list[tuple[str, Any]]:
    """The two variants' layers, (name, layer) each."""
    import torch

    from minisgl.ext.cpu.gguf_quant import Blocks, KScales
    from minisgl.ext.cpu.quantize import vnni_from_blocks
    from minisgl.ext.cpu.quantized import VnniLinear

    gen = torch.Generator().manual_seed(seed)
    low, high, per = {"Q4_0": (0, 16, 32), "Q4_K": (0, 16, 32), "Q5_K": (0, 32, 32),
                      "Q6_K": (-32, 32, 16), "Q8_0": (-127, 128, 32)}[kind]  # fmt: skip
    codes = torch.randint(low, high, (out, cols), generator=gen).to(torch.int16)
    if kind in ("Q4_K", "Q5_K", "Q6_K") and not fp16_rows:
        d = (torch.rand(out, cols // 256, generator=gen) * 0.01).half()
        sc = torch.randint(0 if per == 32 else -64, 64, (out, cols // per), generator=gen)
        mins = (-d, torch.randint(0, 64, (out, cols // 32), generator=gen).to(torch.int8))
        k = KScales(d, sc.to(torch.int8), *(mins if per == 32 else (None, None)))
        scales = d.float().repeat_interleave(256 // per, 1) * sc
        m = None if k.m is None else k.m_scale.float().repeat_interleave(8, 1) * k.m  # type: ignore[union-attr]
        factors = vnni_from_blocks([Blocks(kind, codes, scales, m, k)], four_bit=kind == "Q4_K")
        rows = vnni_from_blocks([Blocks(kind, codes, scales, m)], four_bit=kind == "Q4_K")
        assert factors is not None and rows is not None and factors.k_layout
        return [("K-quant factors", factors), ("float16 rows", rows)]
    scales = (torch.rand(out, cols // per, generator=gen) * 0.01).half()
    layer = vnni_from_blocks([Blocks(kind, codes, scales)], four_bit=kind == "Q4_0")
    assert layer is not None and not layer.has_min, f"{kind}: no kernel layout without mn"
    # the mn that gives the same weights: -8 d at four bits (Q4_0), else 0
    d = layer.scales[:, :, :1]
    mn = -8 * d if kind == "Q4_0" else torch.zeros_like(d)
    with_mn = torch.cat([layer.scales, mn], 2).contiguous()
    return [("without mn", layer), ("with mn", VnniLinear(layer.codes.clone(), with_mn))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kind", default="Q6_K", choices=["Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"])
    p.add_argument(
        "--fp16-rows", action="store_true", help="Q6_K: float16 rows, without mn and with"
    )
    p.add_argument("--out", type=int, default=32768)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="copies run in turn (> L3 together)")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    import torch

    from minisgl.ext.cpu import native

    if native.native_kernel() is None:
        raise SystemExit("minisgl's CPU kernel does not run here (AVX2 and g++ needed)")
    torch.set_num_threads(args.threads)
    copies = [layers(args.kind, args.out, args.cols, s, args.fp16_rows) for s in range(args.layers)]
    x = torch.randn(1, args.cols).bfloat16()
    (name_a, a), (name_b, b) = copies[0]
    if name_b == "with mn" and args.kind != "Q4_0":  # mn = 0: the same bits
        assert torch.equal(a(x), b(x)), "the row of zeros changed the outputs"
    times: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for which in (0, 1) if r % 2 else (1, 0):
            start = time.perf_counter()
            for _ in range(5):
                for pair in copies:
                    pair[which][1](x)
            times[which].append((time.perf_counter() - start) / (5 * len(copies)))
    for which, (name, layer) in enumerate(copies[0]):
        mb = (layer.codes.numel() + layer.scales.numel() * layer.scales.element_size()) / 1e6
        t = sorted(times[which])
        median = t[len(t) // 2]
        print(f"{args.kind} {args.out} x {args.cols}, {name}: {mb:.2f} MB a layer, median "
              f"{median * 1e6:.0f} us, best {t[0] * 1e6:.0f} us, {mb / median / 1e3:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
