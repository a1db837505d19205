"""CPU speed of one GGUF model (default: the embedded SmolLM2-135M-Instruct Q4_1) in minisgl and,
when llama-cpp-python is available, in llama.cpp on the same file with the same cores: decode
tok/s (batch 1, greedy or at `--temperature` with `--top-p` / `--top-k`; `--streams N`: N at once,
minisgl alone; `--decode-tokens` after a short prompt, or after `--context` random token ids: the
keys a long chat's decode attends) and prefill tok/s (one prompt of
`--prompt-tokens` random token ids, a new one each time so no prefix cache helps), printed side
by side with the ratio minisgl / llama.cpp. By default llama.cpp runs a thread per core and
minisgl as it does by default (its decode moves between every core and one, `--cpu-threads`);
`--threads N` fixes both at N.

The two engines run back to back, `--repeats` rounds, each round minisgl then llama.cpp; the
median of the rounds is reported. llama.cpp runs in a child process: this script's interpreter
when it imports `llama_cpp`, else `--llama-cpp-python` (another venv's python that has it).

  python benchmark/offline/bench_cpu.py [--quantization none] [--json benchmark/results.jsonl]
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
from typing import Any

DECODE_PROMPT = "Tell me a long story about a cat who learns to sail."


def random_prompt(count: int, seed: int, vocab: int) -> list[int]:
    """The same ids for both engines: plain tokens from the vocabulary's middle half (special
    tokens sit at its ends)."""
    rng = random.Random(seed)
    return [rng.randint(vocab // 4, vocab * 3 // 4) for _ in range(count)]


def llama_cpp_run(
    model: str, threads: int, decode: int, prompt_tokens: int, seed: int, draw: dict[str, float],
    context: int = 0,
) -> dict:  # fmt: skip
    """One round in llama.cpp: decode tok/s of tokens after DECODE_PROMPT (or `context` random
    ids; EOS ignored, as minisgl's ignore_eos), greedy or drawn as `draw` says (temp, top_k,
    top_p; its min-p off, as minisgl's default), prefill tok/s of a random prompt."""
    from llama_cpp import Llama

    ctx = max(prompt_tokens, context + decode + 64) + 16
    llm = Llama(model, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, verbose=False)
    tokens = llm.tokenize(DECODE_PROMPT.encode())
    if context:
        tokens = random_prompt(context, seed, llm.n_vocab())
    llm.eval(tokens)  # the prompt first: decode time alone is measured
    start = time.perf_counter()
    llm.set_seed(seed)  # (llama-cpp-python's defaults would be top-k 40, top-p 0.95, min-p 0.05)
    # the evaluated prompt is a cache hit (reset=False would evaluate it again into the context)
    for i, _ in enumerate(llm.generate(tokens, min_p=0.0, **draw)):
        if i + 1 == decode:
            break
    decode_s = time.perf_counter() - start
    llm.reset()
    prompt = random_prompt(prompt_tokens, seed, llm.n_vocab())
    start = time.perf_counter()
    llm.eval(prompt)
    prefill_s = time.perf_counter() - start
    return {"decode_tok_s": decode / decode_s, "prefill_tok_s": prompt_tokens / prefill_s}


def llama_cpp_child(args: argparse.Namespace, seed: int) -> dict | None:
    python = sys.executable
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        if not args.llama_cpp_python:
            return None
        python = args.llama_cpp_python
    threads = args.threads or len(os.sched_getaffinity(0))
    cmd = [python, __file__, "--llama-cpp-round", "--model", args.model, "--threads"]
    cmd += [str(threads), "--decode-tokens", str(args.decode_tokens)]
    cmd += ["--prompt-tokens", str(args.prompt_tokens), "--seed", str(seed)]
    cmd += ["--temperature", str(args.temperature), "--top-p", str(args.top_p)]
    cmd += ["--top-k", str(args.top_k), "--context", str(args.context)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def timed(llm: Any, prompt: list[int], params: list[Any]) -> float:
    """Seconds of one generation of `prompt` for each of `params` at once."""
    start = time.perf_counter()
    llm.generate([prompt] * len(params), params, False)
    return time.perf_counter() - start


def minisgl_round(llm: Any, args: argparse.Namespace, seed: int) -> dict:
    from minisgl import SamplingParams

    draw = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    decode = [
        SamplingParams(**draw, seed=seed + i, max_tokens=args.decode_tokens, ignore_eos=True)
        for i in range(args.streams)
    ]
    first = [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * args.streams
    vocab = llm.engine.model_config.vocab_size
    prompt = llm.tokenizer.encode(DECODE_PROMPT)
    if args.context:
        prompt = random_prompt(args.context, seed, vocab)
    llm.generate([prompt], first[0], False)  # caches the prompt: both timed runs below hit it alike
    prompt_s = min(timed(llm, prompt, first) for _ in range(3))  # the same short prefill,
    # subtracted below: the fastest of three, so that one slow run (another process took the
    # core) cannot exceed a whole short decode (a tiny model's 16 tokens in a CI run did)
    decode_s = timed(llm, prompt, decode) - prompt_s
    if decode_s <= 0:
        raise SystemExit("decode time below the timer's noise: raise --decode-tokens")
    start = time.perf_counter()
    llm.generate([random_prompt(args.prompt_tokens, seed, vocab)], first[0], False)
    prefill_s = time.perf_counter() - start
    return {
        "decode_tok_s": args.streams * (args.decode_tokens - 1) / decode_s,
        "prefill_tok_s": args.prompt_tokens / prefill_s,
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", help="GGUF file (default: the embedded SmolLM2)")
    p.add_argument(
        "--threads", type=int,
        help="both engines' threads (minisgl's --cpu-threads); default: llama.cpp every core "
        "of the affinity mask, minisgl its default (--cpu-threads 0: OMP_NUM_THREADS if set)",
    )  # fmt: skip
    p.add_argument("--decode-tokens", type=int, default=256)
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--context", type=int, default=0, help="decode after N random ids (0: short)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quantization", default="auto", help="minisgl's --quantization")
    p.add_argument("--dtype", default="auto", help="minisgl's --dtype")
    p.add_argument(
        "--enable-torch-compile", action="store_true", help="minisgl's (compiled at warm-up)"
    )
    p.add_argument("--llama-cpp-python", help="a python that imports llama_cpp (another venv)")
    p.add_argument("--no-llama-cpp", action="store_true", help="minisgl alone")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--temperature", type=float, default=0.0,
        help="decode at this temperature in both engines (default 0: greedy; the server's is 1)",
    )  # fmt: skip
    p.add_argument("--top-p", type=float, default=1.0, help="both engines' (default 1: off)")
    p.add_argument("--top-k", type=int, default=0, help="both engines' (default 0: off)")
    p.add_argument("--streams", type=int, default=1, help="decode streams at once (minisgl)")
    p.add_argument("--json", help="append one results.jsonl line to this file")
    p.add_argument("--note", default="", help="free text for the JSON line (e.g. the load)")
    p.add_argument("--llama-cpp-round", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    for name in ("threads", "decode_tokens", "prompt_tokens", "repeats", "streams"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.context < 0:
        p.error("--context must be at least 0")
    if not 0 <= args.temperature <= 100:
        p.error("--temperature must be between 0 and 100")
    if not 0 < args.top_p <= 1 or args.top_k < 0:
        p.error("--top-p must be in (0, 1] and --top-k at least 0")
    return args


def report(rows: dict[str, list[dict]], args: argparse.Namespace | None = None) -> dict:
    med = {
        engine: {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        for engine, runs in rows.items()
        if runs
    }
    print(f"{'':10}{'decode tok/s':>14}{'prefill tok/s':>15}")
    for engine, m in med.items():
        print(f"{engine:10}{m['decode_tok_s']:14.1f}{m['prefill_tok_s']:15.1f}")
    out: dict[str, Any] = {f"{e}_{k}": round(v, 2) for e, m in med.items() for k, v in m.items()}
    if "llama.cpp" in med:
        for k in ("decode_tok_s", "prefill_tok_s"):
            out[f"ratio_{k.split('_')[0]}"] = round(med["minisgl"][k] / med["llama.cpp"][k], 3)
        print(f"{'ratio':10}{out['ratio_decode']:14.3f}{out['ratio_prefill']:15.3f}")
    return {k.replace(".", "_"): v for k, v in out.items()}


def main() -> None:
    args = parse_args()
    if args.llama_cpp_round:  # the child: llama.cpp only, no torch imported
        draw = dict(temp=args.temperature, top_k=args.top_k, top_p=args.top_p)
        r = llama_cpp_run(
            args.model, args.threads, args.decode_tokens, args.prompt_tokens, args.seed, draw,
            args.context,
        )  # fmt: skip
        print(json.dumps(r))
        return
    from minisgl import LLM
    from minisgl.ext.cpu.gguf import default_model

    args.model = args.model or default_model()
    limit = max(args.prompt_tokens, args.context) + args.decode_tokens + 64
    compiled = args.enable_torch_compile
    llm = LLM(
        args.model, quantization=args.quantization, dtype=args.dtype, max_model_len=limit,
        enable_torch_compile=compiled, cpu_threads=args.threads or 0,
    )  # fmt: skip
    start = time.perf_counter()
    llm.generate([DECODE_PROMPT], None, False)  # warm-up (and the compile, if asked)
    warmup_s = time.perf_counter() - start
    print(f"minisgl warm-up: {warmup_s:.1f} s")
    rows: dict[str, list[dict]] = {"minisgl": [], "llama.cpp": []}
    if args.streams > 1 and not args.no_llama_cpp:
        print(f"{args.streams} streams: minisgl alone (llama.cpp's round decodes one)")
        args.no_llama_cpp = True
    for i in range(args.repeats):
        rows["minisgl"].append(minisgl_round(llm, args, args.seed + i))
        if not args.no_llama_cpp and (r := llama_cpp_child(args, args.seed + i)) is not None:
            rows["llama.cpp"].append(r)
    if not rows["llama.cpp"] and not args.no_llama_cpp:
        print("llama-cpp-python not found: minisgl alone (see --llama-cpp-python)")
    figures = report(rows, args)
    if args.json:
        import subprocess as sp

        commit = sp.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        line = {
            "bench": "bench_cpu",
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "commit": commit.stdout.strip(),
            "model": os.path.basename(args.model),
            "device": "cpu",
            "threads": args.threads or len(os.sched_getaffinity(0)),
            "threads_auto": args.threads is None,  # minisgl's --cpu-threads 0
            "quantization": llm.engine.quantization,
            "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "torch_compile": compiled,
            "warmup_s": round(warmup_s, 1),
            "decode_tokens": args.decode_tokens,
            "temperature": args.temperature,
            "top_p": args.top_p,
            "top_k": args.top_k,
            "streams": args.streams,
            "prompt_tokens": args.prompt_tokens,
            "context": args.context,
            "repeats": args.repeats,
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "note": args.note,
            **figures,
        }
        with open(args.json, "a") as f:
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
