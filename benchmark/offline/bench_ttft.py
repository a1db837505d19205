"""Time to first token of one request on an idle engine, per prompt length: what a user of an
idle server waits before the pipeline's own hops (HTTP, tokenizer, detokenizer), and how much
of it is the prefill step's host work. Also the time to 8 tokens (first token + 7 decodes).

    python benchmark/offline/bench_ttft.py                            # Qwen3-0.6B, dummy weights
    python benchmark/offline/bench_ttft.py --disable-prefill-graphs   # the ablation: eager prefill
    python benchmark/offline/bench_ttft.py --tiny --device cpu        # CPU smoke test

Each prompt is new (no prefix-cache hit); every length runs twice untimed first (Triton and
the allocator meet its shapes), then --runs times; the medians are reported."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import time
from datetime import datetime, timezone

from bench import commit, tiny_model_dir

FRESH = itertools.count(1000)  # each prompt's own ids: nothing in the radix cache matches it


def fresh_prompt(length: int, vocab: int) -> list[int]:
    k = next(FRESH)
    return [(k * 131 + j * 7) % (vocab - 100) + 100 for j in range(length)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", "--config", default="benchmark/qwen3-0.6b", help="model dir")
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 (CPU smoke test)")
    p.add_argument("--device", default="auto")
    p.add_argument("--lens", default="4,64,250,512,2000", help="prompt lengths, comma-separated")
    p.add_argument("--runs", type=int, default=10, help="timed requests per length")
    p.add_argument("--disable-prefill-graphs", action="store_true", help="eager prefill steps")
    p.add_argument("--json", help="append one JSON line per length to this file")
    args = p.parse_args()
    args.lens = [int(x) for x in args.lens.split(",")]
    if args.runs < 1 or min(args.lens) < 1:
        p.error("--runs and every length of --lens must be >= 1")
    return args


def main() -> None:
    args = parse_args()
    import torch

    from minisgl import LLM, SamplingParams

    model = tiny_model_dir() if args.tiny else args.model
    options = {"device": args.device, "disable_prefill_graphs": args.disable_prefill_graphs}
    llm = LLM(model, dummy_weights=True, **options)
    vocab = llm.engine.model_config.vocab_size
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None

    def timed(length: int, tokens: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate([fresh_prompt(length, vocab)], params, use_tqdm=False)
        sync()
        return time.perf_counter() - start

    for length in args.lens * 2:
        timed(length, 1)
    device = llm.engine.device
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for length in args.lens:
        first = statistics.median(timed(length, 1) for _ in range(args.runs)) * 1e3
        eight = statistics.median(timed(length, 8) for _ in range(args.runs)) * 1e3
        print(f"{gpu}: prompt {length}: first token {first:.1f} ms, 8 tokens {eight:.1f} ms")
        if args.json:
            line = {
                "gpu": gpu,
                "date": datetime.now(timezone.utc).isoformat(timespec="seconds")[:10],
                "commit": commit(),
                "bench": "ttft",
                "model": "tiny" if args.tiny else os.path.basename(os.path.normpath(model)),
                "prompt_tokens": length,
                "runs": args.runs,
                "first_token_ms": round(first, 2),
                "eight_tokens_ms": round(eight, 2),
                "prefill_graphs": not args.disable_prefill_graphs,
            }
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    llm.shutdown()


if __name__ == "__main__":
    main()
