"""Compile the Triton paged decode kernel for a GPU architecture on any machine, GPU or not
(Triton's bundled ptxas and cuobjdump), and report what decides its speed before a device run:
registers per thread, spill instructions, shared memory, how many shared-memory buffers the
software pipeliner gave the K and V loads, and the main loop's length in SASS instructions
(`--mix`: its opcodes). One buffer means the next block's copy starts only after this block's
compute: the load latency is hidden by other programs on the SM alone. Session 23 found this
way that 2-4 stages give one buffer and 5 give two; session 28, that the fp8 kernel reads its
V tile as byte loads (docs/benchmarks.md).

    python benchmark/kernels/inspect_kernels.py                     # decode_tuning's tiles, sm_90
    python benchmark/kernels/inspect_kernels.py --kv-dtype fp8_e4m3 --block-n 64,128 \\
        --num-stages 2,3,5 --maxnreg 0,168"""

from __future__ import annotations

import argparse
import collections
import itertools
import os
import re
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(ROOT, "python"))

from decode_attention_bench import KV_DTYPES  # noqa: E402  (this directory: the bench's names)

TRITON_TYPES = {"bf16": "bf16", "fp8_e4m3": "fp8e4nv", "fp8_e5m2": "fp8e5"}  # KV_DTYPES' keys


@dataclass
class KernelReport:
    registers: int
    spills: int  # local-memory loads and stores in the SASS
    shared_bytes: int
    kv_buffers: int  # shared-memory buffers of the K (and V) tile; 0: not pipelined
    loop: list[str]  # opcodes of the main loop's body (one KV block), in order


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _tool(name: str) -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)


def tools_available() -> bool:
    """Whether this Triton carries the NVIDIA backend's ptxas and cuobjdump."""
    try:
        return all(os.access(_tool(t), os.X_OK) for t in ("ptxas", "cuobjdump", "nvdisasm"))
    except ImportError:
        return False


def compile_decode(
    kv_dtype: str,
    num_splits: int,
    tuning=None,  # minisgl.kernel.triton_attention.DecodeTuning; default: decode_tuning's
    arch: int = 90,
    num_warps: int = 4,
    heads: int = 16,
    kv_heads: int = 8,
    head_dim: int = 128,
    page_size: int = 16,
    rope: bool = False,  # RoPE and the K/V store inside (DecodeRope), with Qwen3's q/k norm
):
    """The compiled `_decode_split_kernel` for bf16 queries over a `kv_dtype` pool, with the
    constexprs `decode_attention` launches it with (PDL on from sm_90)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from minisgl.kernel import triton_attention as ta

    q = torch.empty(1, heads, head_dim, dtype=torch.bfloat16)
    k_pool = torch.empty(1, kv_heads, head_dim, dtype=getattr(torch, KV_DTYPES[kv_dtype]))
    block_n, num_stages, maxnreg = tuning or ta.decode_tuning(k_pool, num_splits, rope)
    group = heads // kv_heads
    constexprs = dict(
        NUM_HEADS=heads, GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        NUM_SPLITS=num_splits, PAGE_SIZE=page_size, HEAD_DIM=head_dim, BLOCK_N=block_n,
        COMPUTE=ta.compute_dtype(q, k_pool), PRECISION="tf32", PDL=arch >= 90,
        ROPE=rope, NORM=rope, HAS_ORDER=not rope,  # the engine orders a batch, not one request
        PAIRS=ta.e4m3_pairs(q, k_pool, rope), PTX=arch >= 89,
    )  # fmt: skip
    kv = TRITON_TYPES[kv_dtype]
    pointers = dict(q="*bf16", k_pool=f"*{kv}", v_pool=f"*{kv}", out="*bf16", part_out="*fp32")
    pointers.update(part_lse="*fp32", page_table="*i32", rows="*i32", kv_lens="*i32", order="*i32")
    pointers.update(new_k="*bf16", new_v="*bf16", cos_sin="*fp32", positions="*i64")
    pointers.update(out_loc="*i64", q_norm_w="*bf16", k_norm_w="*bf16")
    fn = ta._decode_split_kernel
    signature, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "fp32" if name in ("scale", "eps") else "i32")
        if name in pointers or name.startswith("stride"):  # as the runtime specialises them
            attrs[(i,)] = [["tt.divisibility", 16]]
    consts = {(fn.arg_names.index(k),): v for k, v in constexprs.items()}
    options = dict(num_warps=num_warps, num_stages=num_stages, enable_fp_fusion=True)
    if maxnreg:
        options["maxnreg"] = maxnreg
    source = ASTSource(fn, signature, consts, attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def main_loop(sass: str) -> list[str]:
    """Opcodes (no modifiers) of the longest loop in nvdisasm's output: the body between a
    label and the last backward branch to it. Empty when the kernel has no loop."""
    lines = sass.splitlines()
    labels = {m[1]: n for n, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    best = (0, 0)
    for n, line in enumerate(lines):
        target = re.search(r"BRA\s+`\((\.L_x_\d+)\)", line)
        if target and labels.get(target[1], n) < n and n - labels[target[1]] > best[1] - best[0]:
            best = (labels[target[1]], n)
    opcode = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
    return [m[1] for line in lines[best[0] : best[1] + 1] if (m := opcode.search(line))]


def inspect(kernel, block_n: int) -> KernelReport:
    """Registers and spills from the cubin, shared memory from the metadata, K/V buffers from
    the TTGIR's shared-memory allocations of [buffers, block_n, a part of head_dim]."""
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        usage = subprocess.run([_tool("cuobjdump"), "-res-usage", f.name], capture_output=True)
        sass = subprocess.run([_tool("nvdisasm"), f.name], capture_output=True)
    regs = re.search(r"REG:(\d+)", usage.stdout.decode())
    spills = len(re.findall(r"\b(?:LDL|STL)\b", sass.stdout.decode()))
    tile = re.compile(rf"local_alloc : \(\) -> !ttg\.memdesc<(\d+)x{block_n}x\d+x")
    buffers = [int(n) for n in tile.findall(kernel.asm["ttgir"])]
    return KernelReport(
        registers=int(regs[1]) if regs else -1,
        spills=spills,
        shared_bytes=kernel.metadata.shared,
        kv_buffers=max(buffers, default=0),
        loop=main_loop(sass.stdout.decode()),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--kv-dtype", default="bf16,fp8_e4m3", help=f"of {', '.join(TRITON_TYPES)}")
    p.add_argument("--num-splits", type=ints, default=[1, 32], help="1: large batches")
    p.add_argument("--block-n", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--num-stages", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--maxnreg", type=ints, default=[0], help="register caps, 0: none")
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10")
    p.add_argument("--rope", action="store_true", help="RoPE inside the kernel (DecodeRope)")
    p.add_argument("--head-dim", type=ints, default=[128], help="Qwen3-0.6B's: 128")
    p.add_argument("--mix", action="store_true", help="the main loop's opcodes, most common first")
    args = p.parse_args(argv)
    kv_dtypes = args.kv_dtype.split(",")
    if unknown := [d for d in kv_dtypes if d not in KV_DTYPES]:
        print(f"error: --kv-dtype {unknown[0]!r}: expected one of {', '.join(KV_DTYPES)}")
        return 2
    os.environ.pop("TRITON_INTERPRET", None)  # compiled, never interpreted: before the import
    if not tools_available():
        print("error: this Triton has no NVIDIA ptxas / cuobjdump / nvdisasm to compile with")
        return 2
    import torch
    import triton

    from minisgl.kernel.triton_attention import DecodeTuning, decode_tuning

    print(f"Triton {triton.__version__}, sm_{args.arch}, {args.num_warps} warps: registers, spill"
          " instructions, shared memory, K/V buffers (figures move between Triton versions)")  # fmt: skip
    for kv_dtype, splits, head_dim in itertools.product(kv_dtypes, args.num_splits, args.head_dim):
        pool = torch.empty(0, dtype=getattr(torch, KV_DTYPES[kv_dtype]))
        default = decode_tuning(pool, splits, args.rope)
        for block_n, stages, regs in itertools.product(
            args.block_n or [default.block_n],
            args.num_stages or [default.num_stages],
            args.maxnreg,
        ):
            tuning = DecodeTuning(block_n, stages, regs or default.maxnreg)
            kernel = compile_decode(
                kv_dtype,
                splits,
                tuning,
                args.arch,
                args.num_warps,
                head_dim=head_dim,
                rope=args.rope,
            )
            r = inspect(kernel, block_n)
            mark = " (decode_tuning's)" if tuning == default else ""
            print(f"  {kv_dtype:8s} head_dim {head_dim:3d} splits {splits:2d} {tuning}{mark}:"
                  f" {r.registers} registers,"
                  f" {r.spills} spills, {r.shared_bytes / 1024:.1f} KiB shared,"
                  f" {r.kv_buffers} K/V buffers, {len(r.loop)} instructions a block")  # fmt: skip
            if args.mix:
                mix = collections.Counter(r.loop).most_common()
                print("    " + ", ".join(f"{op} {n}" for op, n in mix))
    return 0


if __name__ == "__main__":
    sys.exit(main())
