"""minisgl's CPU kernel (python/minisgl/ext/cpu/qdot.cpp) at decode: one row through `--layers`
copies of a GGUF kind's projection (together larger than L3, so the codes stream from DRAM),
its scales with and without the mn row (Q6_K, Q8_0 and Q4_0 go without it: half a bit a weight
less to read), the two timed in turn (ABBA) in one process. Prints each variant's median and
best time a layer and its GB/s. Needs the kernel (AVX512-VNNI, AVX-VNNI or AVX2, and g++).

    python benchmark/kernels/qdot_bench.py --kind Q6_K --out 32768 --cols 1024  # an LM head
    python benchmark/kernels/qdot_bench.py --kind Q8_0 --out 8192 --cols 2048
    python benchmark/kernels/qdot_bench.py --kind Q4_0 --out 16384 --cols 2048"""

from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))


def layers(kind: str, out: int, cols: int, seed: int) -> tuple[object, object]:
    """(the layer as minisgl builds it, without mn; the same with an mn row of its values)."""
    import torch

    from minisgl.ext.cpu.gguf_quant import Blocks
    from minisgl.ext.cpu.quantize import vnni_from_blocks
    from minisgl.ext.cpu.quantized import VnniLinear

    gen = torch.Generator().manual_seed(seed)
    low, high, per = {"Q4_0": (0, 16, 32), "Q6_K": (-32, 32, 16), "Q8_0": (-127, 128, 32)}[kind]
    codes = torch.randint(low, high, (out, cols), generator=gen).to(torch.int16)
    scales = (torch.rand(out, cols // per, generator=gen) * 0.01).half()
    layer = vnni_from_blocks([Blocks(kind, codes, scales)], four_bit=kind == "Q4_0")
    assert layer is not None and not layer.has_min, f"{kind}: no kernel layout without mn"
    # the mn that gives the same weights: -8 d at four bits (Q4_0), else 0
    d = layer.scales[:, :, :1]
    mn = -8 * d if kind == "Q4_0" else torch.zeros_like(d)
    with_mn = torch.cat([layer.scales, mn], 2).contiguous()
    return layer, VnniLinear(layer.codes.clone(), with_mn)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kind", default="Q6_K", choices=["Q4_0", "Q6_K", "Q8_0"])
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
    pairs = [layers(args.kind, args.out, args.cols, seed) for seed in range(args.layers)]
    x = torch.randn(1, args.cols).bfloat16()
    without, with_mn = pairs[0]
    if args.kind != "Q4_0":  # mn = 0: the same bits (Q4_0's arithmetic differs: d (q - 8))
        assert torch.equal(without(x), with_mn(x)), "the row of zeros changed the outputs"  # type: ignore[operator]
    times: list[list[float]] = [[], []]
    for r in range(args.rounds):
        for which in (0, 1) if r % 2 else (1, 0):
            start = time.perf_counter()
            for _ in range(5):
                for pair in pairs:
                    pair[which](x)  # type: ignore[operator]
            times[which].append((time.perf_counter() - start) / (5 * len(pairs)))
    for which, name in ((0, "without mn"), (1, "with mn")):
        layer = pairs[0][which]
        mb = (layer.codes.numel() + 2 * layer.scales.numel()) / 1e6  # type: ignore[attr-defined]
        t = sorted(times[which])
        median = t[len(t) // 2]
        print(f"{args.kind} {args.out} x {args.cols}, {name}: {mb:.2f} MB a layer, median "
              f"{median * 1e6:.0f} us, best {t[0] * 1e6:.0f} us, {mb / median / 1e3:.1f} GB/s")  # fmt: skip


if __name__ == "__main__":
    main()
