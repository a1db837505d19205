"""Speculative decoding against plain decoding, one request at a time (batch 1), greedy, on
prompts whose answers copy from the prompt (where prompt lookup pays) and one that does not.

    python benchmark/offline/bench_spec.py                      # the embedded SmolLM2, CPU
    python benchmark/offline/bench_spec.py --model DIR --num-draft-tokens 6 --json out.jsonl

For each prompt and mode: decode tok/s = (output tokens - 1) / (time - time to the first token,
measured by a one-token run), the ratio, and the proposals accepted. On the exact path
(`--dtype float32 --quantization none`) the outputs of both modes must be identical (the script
checks); in bf16 or with quantized weights a verify step over K + 1 positions rounds differently
from a one-position decode step, so greedy outputs may part: the script prints how many tokens
agree (as vLLM's and SGLang's speculative decoding in bf16, greedy is exact only up to that)."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from datetime import datetime, timezone
from typing import Any

from bench import commit

PARAGRAPH = (
    "Speculative decoding proposes several tokens cheaply and verifies them in one forward pass "
    "of the target model. When the answer copies from the prompt, as summaries, edits and "
    "retrieval-augmented answers often do, most proposals are accepted and every step yields "
    "several tokens for the price of one, since a step reads every weight once either way."
)
CODE = """def total_price(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    tax = subtotal * tax_rate
    return subtotal + tax
"""
PROMPTS = {
    "repeat": f"Repeat this paragraph exactly:\n\n{PARAGRAPH}",
    "code-edit": f"Rename the function to compute_total and return the same code:\n\n{CODE}",
    "open": "Write a short poem about the sea.",  # little to copy: the cost side
}


def decode_rate(llm: Any, ids: list[int], max_tokens: int, repeat: int) -> dict[str, Any]:
    from minisgl import SamplingParams

    def timed(n: int) -> tuple[float, dict]:
        start = time.perf_counter()
        out = llm.generate([ids], SamplingParams(max_tokens=n), use_tqdm=False)[0]
        return time.perf_counter() - start, out

    timed(4)  # warm-up
    ttft = statistics.median(timed(1)[0] for _ in range(repeat))
    runs = [timed(max_tokens) for _ in range(repeat)]
    seconds = statistics.median(t for t, _ in runs)
    out = runs[0][1]
    n = len(out["token_ids"])
    return {
        "tokens": n,
        "decode_tok_s": (n - 1) / max(seconds - ttft, 1e-9),
        "seconds": seconds,
        "ids": out["token_ids"],
        "accepted": out.get("num_accepted_tokens"),
        "drafted": out.get("num_draft_tokens"),
    }


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2 GGUF")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--num-draft-tokens", type=int, default=4)
    p.add_argument(
        "--max-backoff",
        type=int,
        default=16,
        help="--speculative-max-backoff (0: propose at every step, no overlap)",
    )
    p.add_argument("--repeat", type=int, default=3, help="timed runs per mode (the median)")
    p.add_argument("--prompts", default=",".join(PROMPTS), help="which of " + ", ".join(PROMPTS))
    p.add_argument("--dtype", default="auto", help="the engine's --dtype (float32: exact)")
    p.add_argument("--quantization", default="auto", help="the engine's (none: exact)")
    p.add_argument("--json", help="append one JSON line per prompt to this file")
    return p.parse_args()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    args = parse_args()
    from minisgl import LLM

    names = args.prompts.split(",")
    if unknown := [n for n in names if n not in PROMPTS]:
        raise SystemExit(f"--prompts: unknown {unknown}; known: {', '.join(PROMPTS)}")
    results: dict[str, dict[str, dict]] = {n: {} for n in names}
    for mode in ("plain", "ngram"):
        spec: dict[str, Any] = {}
        if mode == "ngram":
            spec = {"speculative_algorithm": "ngram", "speculative_max_backoff": args.max_backoff}
        llm = LLM(
            args.model,
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            speculative_num_draft_tokens=args.num_draft_tokens,
            **spec,
        )
        try:
            for name in names:
                ids = llm.apply_chat_template([{"role": "user", "content": PROMPTS[name]}])
                results[name][mode] = decode_rate(llm, ids, args.max_tokens, args.repeat)
        finally:
            llm.shutdown()
    for name in names:
        plain, ngram = results[name]["plain"], results[name]["ngram"]
        same = common_prefix(plain["ids"], ngram["ids"])
        exact = args.dtype == "float32" and args.quantization == "none"
        identical = plain["ids"] == ngram["ids"]
        assert identical or not exact, f"{name}: speculation changed the exact path's output"
        ratio = ngram["decode_tok_s"] / plain["decode_tok_s"]
        steps = ngram["tokens"] - (ngram["accepted"] or 0)
        per_step = ngram["tokens"] / max(steps, 1)
        print(
            f"{name:>10}: plain {plain['decode_tok_s']:.1f} tok/s, ngram {ngram['decode_tok_s']:.1f}"
            f" tok/s ({ratio:.2f}x); {ngram['accepted']}/{ngram['drafted']} proposals accepted,"
            f" {per_step:.2f} tokens per step, {ngram['tokens']} tokens"
            + ("" if identical else f"; outputs agree on the first {same} tokens")
        )
        if args.json:
            line = {
                "bench": "bench_spec",
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                "commit": commit(),
                "model": args.model or "embedded SmolLM2",
                "device": args.device,
                "prompt": name,
                "num_draft_tokens": args.num_draft_tokens,
                "max_backoff": args.max_backoff,
                "plain_tok_s": round(plain["decode_tok_s"], 2),
                "ngram_tok_s": round(ngram["decode_tok_s"], 2),
                "speedup": round(ratio, 3),
                "accepted": ngram["accepted"],
                "drafted": ngram["drafted"],
                "tokens_per_step": round(per_step, 3),
                "dtype": args.dtype,
                "quantization": args.quantization,
                "same_output": identical,
                "common_prefix": same,
            }
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
