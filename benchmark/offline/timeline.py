"""Where a decode step's time goes: the GPU's idle gaps and each kernel's share per step.

Runs the offline engine (dummy weights) on `--requests` requests (or, with `--bench`, bench.py's
workload) under torch's profiler with CPU and CUDA activity, then prints the GPU's busy fraction
by tenth of the run and, over `--window` (default the middle half, steady decode): the GPU's
busy fraction (the union of kernel and copy intervals, so kernels that overlap under PDL count
once), its idle gaps (largest first, with the kernels around each and the host's longest ops
and CUDA calls over it), and every kernel's count per step and mean duration (which includes a PDL kernel's wait).
`--trace` also writes the Chrome trace (open in Perfetto). Session 25 found with it that one
stream's step spent ~80 us in small dependent kernels around the model (docs/benchmarks.md).

    python benchmark/offline/timeline.py --config benchmark/qwen3-0.6b             # one stream
    python benchmark/offline/timeline.py --config benchmark/qwen3-0.6b --requests 64 --trace t.json
    python benchmark/offline/timeline.py --requests 256 --prompt-len 800 --tokens 200  # long KV
    python benchmark/offline/timeline.py --bench --requests 256 --prompt-len 1024 --tokens 300 \
        --window 0:0.2                                                              # prefill phase
    python benchmark/offline/timeline.py --tiny --device cpu                       # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from collections import defaultdict
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# after PYTHONPATH, so an A/B can run another tree's package (PYTHONPATH=tree/python)
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

Event = dict[str, Any]  # a Chrome-trace "X" event: name, cat, ts (us), dur (us), args
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


class Gap(NamedTuple):
    start: float  # us, trace clock
    length: float
    before: str  # the device op that ended last
    after: str  # the device op that starts the work again


def idle_gaps(device_ops: list[Event]) -> tuple[float, float, list[Gap]]:
    """(busy us, span us, gaps) of device ops sorted by start: busy is the union of their
    intervals, a gap any stretch with none running."""
    if not device_ops:
        return 0.0, 0.0, []
    first = device_ops[0]
    busy, end, last, gaps = 0.0, first["ts"], first, []
    for op in device_ops:
        start, stop = op["ts"], op["ts"] + op["dur"]
        if start > end:
            gaps.append(Gap(end, start - end, last["name"], op["name"]))
        busy += max(0.0, stop - max(start, end))
        if stop >= end:
            end, last = stop, op
    return busy, end - first["ts"], gaps


def device_ops(kineto_events: Any) -> list[Event]:
    """The kernels, copies and memsets of torch's `_KinetoEvent`s as trace events (name, ts and
    dur in us), sorted by start."""
    ops = [
        {"name": e.name(), "ts": e.start_ns() / 1e3, "dur": e.duration_ns() / 1e3}
        for e in kineto_events
        if device_work(e)
    ]
    return sorted(ops, key=lambda op: op["ts"])


def busy_by_slice(ops: list[Event], slices: int = 10) -> list[tuple[float, str]]:
    """(busy fraction, the kind with the most GPU time) of each of `slices` equal stretches of
    the ops' span (sorted by start): where in a run the idle time lies (the prefill phase,
    steady decode, the tail of small batches). One pass: each op is cut at the slices' edges."""
    if not ops:
        return []
    first, last = ops[0]["ts"], max(op["ts"] + op["dur"] for op in ops)
    width = (last - first) / slices or 1.0
    pieces: list[list[Event]] = [[] for _ in range(slices)]
    for op in ops:
        start, stop = op["ts"], op["ts"] + op["dur"]
        for i in range(int((start - first) / width), min(slices, int((stop - first) / width) + 1)):
            lo, hi = first + i * width, first + (i + 1) * width
            if min(stop, hi) > max(start, lo):
                pieces[i].append(
                    {**op, "ts": max(start, lo), "dur": min(stop, hi) - max(start, lo)}
                )
    rows = []
    for inside in pieces:
        kinds: dict[str, float] = defaultdict(float)
        for op in inside:
            kinds[kind_of(op["name"])] += op["dur"]
        busy = idle_gaps(inside)[0] if inside else 0.0
        rows.append((busy / width, max(kinds, key=kinds.__getitem__) if kinds else "-"))
    return rows


def device_work(kineto_event: Any) -> bool:
    """Whether a `_KinetoEvent` is a kernel, copy or memset: not the host's ops, nor an
    annotation's GPU range. torch 2.13 names the activity; torch 2.11 (the GPU machines' image)
    only gives the device, which annotations share."""
    if hasattr(kineto_event, "activity_type"):
        return kineto_event.activity_type() in DEVICE_CATEGORIES
    from torch.autograd import DeviceType

    return kineto_event.device_type() == DeviceType.CUDA and not kineto_event.is_user_annotation()


# kernel-name fragments of each kind, first match wins (torch's, Triton's and cuBLAS's names)
KERNEL_KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("decode attention", ("_decode_split", "_decode_merge", "BatchDecode")),
    ("extend attention", ("_extend_kernel", "BatchPrefill")),
    ("GEMV", ("_gemv_kernel", "_reduce_kernel")),
    ("GEMM", ("nvjet", "gemm", "cutlass", "xmma")),
    ("norm", ("rms_norm",)),
    ("rotary + KV store", ("_rotary", "_store_kv")),
    ("activation", ("silu",)),
    ("sampling", ("gumbel", "_pick", "sampl", "argmax", "_adjust")),
    ("copies", ("Memcpy", "Memset")),
)


def kernel_groups(seconds: dict[str, float]) -> list[tuple[str, float]]:
    """GPU seconds by kind of kernel (KERNEL_KINDS, else "other"), the largest first, from
    seconds per kernel name."""
    totals: dict[str, float] = defaultdict(float)
    for name, secs in seconds.items():
        totals[kind_of(name)] += secs
    return sorted(totals.items(), key=lambda item: -item[1])


def kind_of(kernel_name: str) -> str:
    """The KERNEL_KINDS kind of a kernel name, else "other"."""
    return next((k for k, parts in KERNEL_KINDS if any(p in kernel_name for p in parts)), "other")


def gaps_by_next_kind(gaps: list[Gap]) -> list[tuple[str, int, float]]:
    """(kind, gaps, us) of the idle time grouped by the kind of op that ends each gap, the most
    first: a kernel launched without PDL (cuBLAS) waits for the one before to end, then for
    its own launch, so its gaps name it."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for gap in gaps:
        entry = totals[kind_of(gap.after)]
        entry[0] += 1
        entry[1] += gap.length
    return sorted(((k, int(n), us) for k, (n, us) in totals.items()), key=lambda r: -r[2])


def per_kernel(device_ops: list[Event], steps: int) -> list[tuple[str, float, float]]:
    """(name, launches per step, mean us) of each device op, the most total time first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for op in device_ops:
        entry = totals[op["name"]]
        entry[0] += 1
        entry[1] += op["dur"]
    rows = [(name, n / max(steps, 1), us / n) for name, (n, us) in totals.items()]
    return sorted(rows, key=lambda row: -row[1] * row[2])


def host_during(host: list[Event], gap: Gap, longest: int = 4) -> str:
    """The host's longest ops and CUDA calls (us) that overlap a gap: what kept it from
    launching the next device op."""
    stop = gap.start + gap.length
    inside = [h for h in host if h["ts"] < stop and h["ts"] + h.get("dur", 0) > gap.start]
    inside.sort(key=lambda h: -h.get("dur", 0))
    return " ".join(f"{h['name'][:32]}:{h.get('dur', 0):.0f}" for h in inside[:longest]) or "-"


class Step(NamedTuple):
    ops: int  # device ops: a graph replay's and an eager step's differ
    span: float  # us from the step's first device op to its last one's end
    busy: float  # us of that span with a device op running
    launch: float  # us from the host's launch of its first op to that of its last
    lead: float  # us from the launch of its first op to its start: ~0, the GPU waited for it


def steps_of(events: list[Event]) -> list[Step]:
    """The run's steps (each ends with its device-to-host copy of the sampled tokens), their
    device ops matched to the host's launch calls by the trace's correlation ids."""
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    steps, current = [], []
    for op in ops:
        current.append(op)
        if "DtoH" not in op["name"]:
            continue
        busy, span, _ = idle_gaps(current)
        called = [
            launches[c] for o in current if (c := o.get("args", {}).get("correlation")) in launches
        ]
        first = min((c["ts"] for c in called), default=current[0]["ts"])
        last = max((c["ts"] for c in called), default=current[0]["ts"])
        steps.append(Step(len(current), span, busy, last - first, current[0]["ts"] - first))
        current = []
    return steps


def report_steps(steps: list[Step], behind_us: float = 100.0, kinds: int = 6) -> None:
    """Steps grouped by their device-op count, the most time first: mean span, busy and host
    launch time, and how many began with the host less than `behind_us` ahead (the GPU idle
    until the host caught up: host-bound steps)."""
    groups: dict[int, list[Step]] = defaultdict(list)
    for step in steps:
        groups[step.ops].append(step)
    ranked = sorted(groups.items(), key=lambda g: -sum(s.span for s in g[1]))
    print(f"{len(steps)} steps; by device ops a step (mean ms: span, busy, host launch):")
    for ops, group in ranked[:kinds]:
        n = len(group)
        span, busy = sum(s.span for s in group) / n / 1e3, sum(s.busy for s in group) / n / 1e3
        launch, behind = (
            sum(s.launch for s in group) / n / 1e3,
            sum(s.lead < behind_us for s in group),
        )
        print(f"  {ops:5d} ops x {n:4d}: {span:7.2f} {busy:7.2f} {launch:7.2f}"
              f"   the host behind at the start of {behind}")  # fmt: skip


def report(
    events: list[Event], tokens_per_request: int, window: tuple[float, float], top: int = 12
) -> None:
    ops = sorted((e for e in events if e.get("cat") in DEVICE_CATEGORIES), key=lambda e: e["ts"])
    if not ops:
        print("no device activity (a CPU run): nothing to report")
        return
    tenths = ", ".join(f"{busy:.0%}" for busy, _ in busy_by_slice(ops))
    print(f"GPU busy by tenth of the run: {tenths}")
    steady = ops[int(window[0] * len(ops)) : int(window[1] * len(ops))]  # default: steady decode
    busy, span, gaps = idle_gaps(steady)
    steps = round(tokens_per_request * len(steady) / len(ops))
    print(f"window {span:,.0f} us, ~{steps} steps: GPU busy {busy:,.0f} us ({busy / span:.1%})")
    print(f"{len(gaps)} gaps, {sum(g.length for g in gaps):,.0f} us in all; the largest:")
    host = [e for e in events if e.get("cat") in ("cuda_runtime", "cpu_op", "user_annotation")]
    for gap in sorted(gaps, key=lambda g: -g.length)[:top]:
        print(f"  {gap.length:8.1f} us after {gap.before[:40]} before {gap.after[:40]}"
              f"  host: {host_during(host, gap)}")  # fmt: skip
    by_kind = gaps_by_next_kind(gaps)
    print("idle before: " + ", ".join(f"{k} {us:,.0f} us ({n} gaps)" for k, n, us in by_kind))
    print(f"{'per step':>9} {'mean us':>8}  device op")
    for name, per_step, mean in per_kernel(steady, steps)[: 2 * top]:
        print(f"{per_step:9.2f} {mean:8.2f}  {name[:90]}")
    first, last = steady[0]["ts"], steady[-1]["ts"]
    window_events = [
        e for e in events if e.get("cat") not in DEVICE_CATEGORIES or first <= e["ts"] <= last
    ]
    report_steps(steps_of(window_events))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--config", default="benchmark/qwen3-0.6b", help="model directory")
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 (smoke runs)")
    p.add_argument("--device", default="auto", help="auto (cuda when present), cuda or cpu")
    p.add_argument("--requests", type=int, default=1)
    p.add_argument("--tokens", type=int, default=400, help="output tokens per request")
    p.add_argument("--prompt-len", type=int, default=100, help="prompt tokens per request")
    p.add_argument("--attn", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--trace", default=None, help="also write the Chrome trace here")
    p.add_argument(
        "--bench",
        action="store_true",
        help="bench.py's workload (random lengths up to --prompt-len and --tokens) and warm-up",
    )
    p.add_argument(
        "--window",
        default="0.25:0.75",
        help="the stretch of the run's device ops reported, as fractions (default: the middle"
        " half, steady decode; 0:0.3 covers the prefill phase)",
    )
    return p.parse_args()


def workload_of(args: argparse.Namespace) -> tuple[list, list, list, list]:
    """(prompts, params, warm-up prompts, warm-up params): --requests alike, or with --bench
    bench.py's workload (lengths drawn up to --prompt-len and --tokens) and its warm-up."""
    from bench import shifted, workload

    from minisgl import SamplingParams

    if not args.bench:
        params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=args.tokens)
        prompts = [[1000 + 7 * i + j for j in range(args.prompt_len)] for i in range(args.requests)]
        return prompts, [params] * len(prompts), shifted(prompts, 5000), [params] * len(prompts)
    prompts, lengths = workload(args.requests, args.prompt_len, args.tokens)
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n) for n in lengths]
    warm = [SamplingParams(temperature=0.6, max_tokens=4 + i % 5) for i in range(24)]
    return prompts, params, shifted(workload(24, 300, 100)[0], 5000), warm


def main() -> None:
    args = parse_args()
    import torch
    from bench import tiny_model_dir
    from torch.profiler import ProfilerActivity, profile

    from minisgl import LLM

    model = tiny_model_dir() if args.tiny else args.config
    llm = LLM(model, dummy_weights=True, device=args.device, attn=args.attn,
              kv_cache_dtype=args.kv_cache_dtype)  # fmt: skip
    prompts, params, warm_prompts, warm_params = workload_of(args)
    llm.generate(warm_prompts, warm_params, use_tqdm=False)
    cuda = llm.engine.device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else lambda: None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    sync()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        sync()
        seconds = time.perf_counter() - start
    llm.shutdown()
    total = sum(p.max_tokens for p in params)
    print(f"{total} tokens in {seconds * 1e3:.1f} ms = {total / seconds:,.1f} tok/s (profiled)")
    path = args.trace or os.path.join(tempfile.mkdtemp(prefix="minisgl_trace_"), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    start_frac, end_frac = (float(x) for x in args.window.split(":"))
    report(events, max(p.max_tokens for p in params), (start_frac, end_frac))


if __name__ == "__main__":
    main()
