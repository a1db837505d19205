"""The Triton decode attention over the offline benchmark's whole run: every decode step of
`bench.py`'s workload (its prompt and output lengths, the requests leaving as their outputs
end), each step's batch on its own CUDA graph, the kernel at the engine's split count and tuning
or at the variants asked for. It prints the run's total decode-attention time (a layer's times
`--layers`), the KV bytes read and their rate: what `--profile` reports of a real run, without
the model around it, so that variants of the kernel compare on the run's mix of batch sizes
(alone, `decode_attention_bench.py` times one batch). A small step's KV fits the L2 cache across the graph's replays, which a run
(each layer its own KV) does not give it: the tail's rate is an upper bound.

    python benchmark/kernels/decode_replay_bench.py                        # bf16, every 8th step
    python benchmark/kernels/decode_replay_bench.py --kv-dtype fp8_e4m3 --heads 32 \\
        --programs-per-sm 4,8 --block-n 32,64 --num-stages 2,3
    python benchmark/kernels/decode_replay_bench.py --smoke                # CPU interpreter"""

from __future__ import annotations

import argparse
import itertools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.append(os.path.join(ROOT, "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode_attention_bench import (  # noqa: E402
    KV_DTYPES,
    add_common_args,
    ints,
    reference,
    setup,
    time_us,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--stride", type=int, default=8, help="time every N-th step, weigh it N")
    p.add_argument("--layers", type=int, default=28, help="the model's (Qwen3-0.6B: 28; 8B: 36)")
    add_common_args(p, "bf16")
    p.add_argument("--programs-per-sm", type=ints, default=[4], help="decode_splits' target")
    p.add_argument("--block-n", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--num-warps", type=ints, default=[4])
    p.add_argument("--num-stages", type=ints, default=None, help="default: decode_tuning's")
    p.add_argument("--per-step", action="store_true", help="a line for every timed step too")
    args = p.parse_args(argv)
    if args.smoke:
        args.num_seqs, args.max_input_len, args.max_output_len, args.stride = 3, 120, 110, 50
        args.heads, args.kv_heads, args.head_dim, args.page_size, args.reps = 4, 2, 16, 4, 1
    return args


def steps(prompts: list[int], outputs: list[int]) -> list[list[int]]:
    """Each decode step's KV lengths (the new token included): the prefill samples the first
    output token, step s computes token s + 1 of every request still short of its output."""
    longest = max(outputs)
    return [[p + s for p, o in zip(prompts, outputs) if s < o] for s in range(1, longest)]


def step_operands(lens: list[int], args: argparse.Namespace, slots_pages: int, gen, device):
    """(q, page table, rows, kv_lens, order) of one step's batch, on `device`: each request's
    pages a random subset of the pool's, as after a run's allocations and frees."""
    import torch

    pages = [-(-x // args.page_size) for x in lens]
    perm = torch.randperm(slots_pages, generator=gen).to(torch.int32)
    table = torch.zeros(len(lens), max(pages), dtype=torch.int32)
    start = 0
    for j, m in enumerate(pages):
        table[j, :m] = perm[start : start + m]
        start += m
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    order = torch.argsort(kv_lens, descending=True, stable=True).to(torch.int32)
    q_dtype = torch.float16 if args.smoke else torch.bfloat16
    q = torch.randn(len(lens), args.heads, args.head_dim, generator=gen).to(q_dtype)
    rows = torch.arange(len(lens), dtype=torch.int32)
    return [t.to(device) for t in (q, table, rows, kv_lens, order)]


def replay(args, run, pools, config, gen, device) -> tuple[float, int, float]:
    """(one layer's decode attention us over the run, its KV bytes, the largest error against
    the reference at the first and last timed steps) for one configuration."""
    from minisgl.kernel import triton_attention as ta

    k_pool, v_pool = pools
    per_sm, block_n, warps, stages = config
    sms, scale = ta.num_sms(device), args.head_dim**-0.5
    timed = list(range(0, len(run), args.stride))
    total_us, total_bytes, err = 0.0, 0, 0.0
    for i in timed:
        n = ta.decode_splits(len(run[i]), args.kv_heads, sms, per_sm)
        tuning = ta.DecodeTuning(block_n, stages or ta.decode_tuning(k_pool, n).num_stages)
        ops = step_operands(run[i], args, k_pool.shape[0] // args.page_size, gen, device)

        def step(ops=ops, n=n, tuning=tuning):
            q, table, rows, kv_lens, order = ops
            return ta.decode_attention(
                q, k_pool, v_pool, table, rows, kv_lens, n, args.page_size, scale,
                tuning=tuning, num_warps=warps, order=order,
            )  # fmt: skip

        if i in (timed[0], timed[-1]):
            lens = ops[3].cpu()
            ref = reference(ops[0], k_pool, v_pool, ops[1], lens, args.page_size, scale)
            err = max(err, (step().float() - ref).abs().max().item())
        weight = min(args.stride, len(run) - i)
        us = time_us(step, args.reps, device.type == "cuda")
        nbytes = sum(run[i]) * args.kv_heads * args.head_dim * 2 * k_pool.element_size()
        total_us, total_bytes = total_us + us * weight, total_bytes + nbytes * weight
        if args.per_step:
            print(f"  step {i + 1}: {len(run[i])} requests, {n} splits, {us:.1f} us, "
                  f"{nbytes / us / 1e6:.2f} TB/s")  # fmt: skip
    return total_us, total_bytes, err


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, peak = setup(args.smoke, 0)
    import torch

    from minisgl.kernel import triton_attention as ta

    sys.path.insert(0, os.path.join(ROOT, "benchmark", "offline"))
    from bench import workload  # its prompts and output token counts, drawn alike

    prompt_ids, outputs = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    prompts = [len(p) for p in prompt_ids]
    run = steps(prompts, outputs)
    gen = torch.Generator().manual_seed(0)
    most = max(len(r) for r in run) * -(-(max(prompts) + max(outputs)) // args.page_size)
    for kv_name in args.kv_dtype.split(","):
        dtype = getattr(torch, KV_DTYPES[kv_name])
        if args.smoke and dtype == torch.bfloat16:  # the interpreter has no bfloat16 loads
            dtype = torch.float16
        shape = (most * args.page_size, args.kv_heads, args.head_dim)
        pools = [torch.randn(shape, generator=gen).to(dtype).to(device) for _ in "kv"]
        default = ta.decode_tuning(pools[0], 1)
        configs = itertools.product(
            args.programs_per_sm,
            args.block_n or [default.block_n],
            args.num_warps,
            args.num_stages or [None],
        )
        for config in configs:
            us, nbytes, err = replay(args, run, pools, config, gen, device)
            us, nbytes = us * args.layers, nbytes * args.layers
            per_sm, block_n, warps, stages = config
            label = f"{kv_name} heads {args.heads}: per_sm {per_sm} block_n {block_n} "
            label += f"warps {warps} stages {'default' if stages is None else stages}"
            if err > 5e-2:
                print(f"{label}: WRONG, max error {err:.3g}")
                continue
            rate = nbytes / us / 1e6
            share = f" ({rate / peak:.0%} of {peak:g})" if peak else ""
            print(
                f"{label}: {us / 1e6:.4f} s over {len(run)} steps ({us / len(run):.1f} us a "
                f"step), {nbytes / 1e12:.3f} TB, {rate:.2f} TB/s{share}, max error {err:.2g}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
