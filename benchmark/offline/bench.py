"""Offline throughput benchmark: the nano-vllm workload (256 requests, random prompts of 100-1024
tokens, 100-1024 output tokens each with ignore_eos, temperature 0.6: 133,966 output tokens) on
the Qwen3-0.6B architecture with dummy weights, and its fraction of the GPU's roofline.

    python benchmark/offline/bench.py                        # defaults: overlap, graphs, auto
    python benchmark/offline/bench.py --no-overlap           # ablations
    python benchmark/offline/bench.py --cuda-graph-max-bs 0 --attn triton
    python benchmark/offline/bench.py --single               # one request's decode tok/s
    python benchmark/offline/bench.py --tiny --device cpu    # CPU smoke test (tiny model)
    python benchmark/offline/bench.py --config benchmark/qwen3-8b --tp 2
    python benchmark/offline/bench.py --config benchmark/qwen3-30b-a3b --tp 2 --moe-backend torch
    python benchmark/offline/bench.py --config benchmark/qwen3-8b --lora-adapters 4  # multi-LoRA

Roofline: prefill costs, at the GPU's dense bf16 peak, 2 * params FLOPs per prompt token without
the embedding (a lookup) and the LM head (once per prompt: its last token's logits), plus the
causal attention's 4 * heads * head_dim * layers per (query, key) pair, a prompt of n tokens
having n (n + 1) / 2 (at 16,000-token prompts as many FLOPs as the weights'; before 2026-12-01
the roofline counted 2 * params a token and no attention: `--old-roofline`); each
decode step reads every weight once plus the whole KV (prompt + generated so far, the new token
included) of every running request at the GPU's memory bandwidth; requests run as one batch
from the start, each leaving when its output is complete. MoE models: a token uses top_k / E of
the experts' weights (FLOPs), and a decode step of b requests reads the share of them that some
request routes to, 1 - (1 - top_k / E)^b (uniform routing). With --tp N the figures are one
GPU's: rank 0's shard of the weights and KV, against one GPU's peaks (no communication cost).
With --lora-adapters the roofline is the base model's (the adapters' reads and FLOPs not
counted)."""

from __future__ import annotations

import argparse
import atexit
import contextlib
import cProfile
import json
import os
import pstats
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from random import randint, seed
from typing import Any

import step_times  # this directory

# (memory bandwidth bytes/s, dense bf16 FLOP/s) from the vendors' data sheets
GPU_PEAKS = {
    "H100 80GB HBM3": (3.35e12, 989e12),  # H100 SXM
    "H100 PCIe": (2.0e12, 756e12),
    "H200": (4.8e12, 989e12),
}


def workload(num_seqs: int, max_input: int, max_output: int) -> tuple[list, list[int]]:
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_input))] for _ in range(num_seqs)]
    max_tokens = [randint(100, max_output) for _ in range(num_seqs)]
    return prompts, max_tokens


def shifted(prompts: list[list[int]], by: int) -> list[list[int]]:
    """The prompts with every token id moved by `by` (mod 10,000): same lengths, no prefix in
    common with the originals, so the radix cache cannot skip a run's prefill."""
    return [[(t + by) % 10000 for t in p] for p in prompts]


def roofline_tok_s(
    prompt_lens: list[int],
    output_lens: list[int],
    weight_bytes: float,
    kv_bytes_per_token: float,
    params: float,
    bandwidth: float,
    flops: float,
    expert_bytes: float = 0.0,  # MoE: the experts' share of the weights, not in weight_bytes
    expert_params: float = 0.0,  # and of the parameters, not in params
    expert_share: float = 1.0,  # top_k / num_experts
    vocab_params: float = 0.0,  # the embedding and an untied LM head: none a prompt token's
    head_params: float = 0.0,  # the LM head: once a prompt
    attn_flops_per_pair: float = 0.0,  # 4 x query heads x head_dim x layers
) -> float:
    active = params - vocab_params + expert_share * expert_params
    seconds = sum(prompt_lens) * 2 * active / flops
    seconds += len(prompt_lens) * 2 * head_params / flops
    seconds += sum(n * (n + 1) / 2 for n in prompt_lens) * attn_flops_per_pair / flops
    pending = sorted(zip(output_lens, prompt_lens))
    running_prompt, running = sum(prompt_lens), len(prompt_lens)
    first = 0
    for step in range(max(output_lens)):
        while pending[first][0] <= step:  # requests whose output is complete leave
            running_prompt -= pending[first][1]
            running -= 1
            first += 1
        kv_tokens = running_prompt + running * (step + 1)
        experts_read = expert_bytes * (1 - (1 - expert_share) ** running)
        seconds += (weight_bytes + experts_read + kv_tokens * kv_bytes_per_token) / bandwidth
    return sum(output_lens) / seconds


def roofline(
    engine: Any,
    gpu: str,
    prompts: list[list[int]],
    max_tokens: list[int],
    tok_s: float,
    tp_size: int = 1,
    old: bool = False,  # the roofline before 2026-12-01: 2 * params a prompt token, no attention
) -> dict[str, float | str]:
    """The roofline of this workload on this GPU (empty when its peaks are unknown): rank 0's
    shard (tied weights count once), the experts apart (a token uses top_k of them)."""
    peaks = next((v for k, v in GPU_PEAKS.items() if k in gpu), None)
    if peaks is None:
        return {}
    moe = engine.model_config.moe
    num_params, weight_bytes = param_size(list(engine.model.parameters()))
    expert_params, expert_bytes = param_size(
        [p for name, p in engine.model.named_parameters() if ".experts." in name]
    )
    kv = engine.kv_cache
    kv_per_token = 2 * kv.num_layers * kv.num_kv_heads * kv.head_dim * kv.dtype.itemsize
    named = dict(engine.model.named_parameters())  # tied: the LM head is the embedding's
    head = named.get("lm_head.weight", named.get("model.embed_tokens.weight"))
    vocab = [p for name, p in named.items() if "embed_tokens" in name or "lm_head" in name]
    heads = engine.model_config.num_heads // tp_size
    roof = roofline_tok_s(
        [len(p) for p in prompts],
        max_tokens,
        weight_bytes - expert_bytes,
        kv_per_token,
        num_params - expert_params,
        *peaks,
        expert_bytes=expert_bytes,
        expert_params=expert_params,
        expert_share=moe.top_k / moe.num_experts if moe is not None else 1.0,
        **({} if old else dict(
            vocab_params=param_size(vocab)[0],
            head_params=0 if head is None else head.numel(),
            attn_flops_per_pair=4 * heads * kv.head_dim * kv.num_layers,
        )),
    )  # fmt: skip
    return {
        "roofline_tok_s": round(roof, 1),
        "roofline_fraction": round(tok_s / roof, 4),
        "roofline_model": "params" if old else "params+attention",  # "params": before 2026-12-01
    }


def param_size(params: list) -> tuple[int, int]:
    """(number of parameters, bytes)"""
    return sum(p.numel() for p in params), sum(p.nbytes for p in params)


# The tiny random Qwen3 of --tiny (its MoE variant in tests/test_bench.py adds experts)
TINY_QWEN3 = dict(
    vocab_size=10240,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=4096,
)


def tiny_model_dir() -> str:
    from transformers import Qwen3Config

    path = tempfile.mkdtemp(prefix="minisgl_bench_")
    config = Qwen3Config(**TINY_QWEN3, tie_word_embeddings=True)
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(path)
    return path


# A string that random text rarely closes: every constrained request runs (nearly) to its length,
# so 0% and 100% constrained runs generate the same tokens, every step under a grammar mask.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string"}},
    "required": ["answer"],
}


def synthetic_vocab(vocab_size: int) -> Any:
    """An xgrammar tokenizer for a dummy-weight model without tokenizer files: the 256 bytes,
    then random 2-8 character strings (a real vocabulary's mask costs), the last id as EOS."""
    import random

    import xgrammar as xgr

    rng = random.Random(0)
    chars = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;!?-_()[]{}"
    vocab = [bytes([i]) for i in range(256)]
    vocab += [
        "".join(rng.choices(chars, k=rng.randint(2, 8))).encode() for _ in range(vocab_size - 257)
    ]
    vocab.append(b"")
    return xgr.TokenizerInfo(vocab, vocab_size=vocab_size, stop_token_ids=[vocab_size - 1])


def constrain(llm: Any, frac: float, tp: int) -> Any:
    """i -> the SamplingParams fields of request i: BENCH_SCHEMA for a `frac` share of them."""
    if not 0.0 <= frac <= 1.0:
        raise SystemExit(f"--grammar-frac must be in [0, 1], got {frac}")
    if frac == 0.0:
        return lambda i: {}
    if llm.tokenizer is None:
        if tp > 1 or getattr(llm, "replicas", None) is not None:  # (dp: the serving extension's)
            raise SystemExit("--grammar-frac with --tp or --dp > 1 needs a model with a tokenizer")
        llm.scheduler.tokenizer = synthetic_vocab(llm.engine.model_config.vocab_size)
    return lambda i: {"json_schema": BENCH_SCHEMA} if chosen(i, frac) else {}


def chosen(i: int, frac: float) -> bool:
    """Whether request i is in a `frac` share: when the running count floor(i * frac) steps up."""
    return int((i + 1) * frac) > int(i * frac)


# every logit adjustment and logprobs=5: the worst case of issue 15's sampling features
FEATURES = dict(
    frequency_penalty=0.5,
    presence_penalty=0.5,
    repetition_penalty=1.1,
    logit_bias={11: -5.0, 13: 2.0, 17: -100.0, 19: 1.0},
    logprobs=5,
)


FEATURE_GROUPS = {
    "penalties": ("frequency_penalty", "presence_penalty", "repetition_penalty"),
    "bias": ("logit_bias",),
    "logprobs": ("logprobs",),
}


def featured(frac: float, groups: str) -> Any:
    """i -> FEATURES (those of the named groups) for a `frac` share of the requests."""
    if not 0.0 <= frac <= 1.0:
        raise SystemExit(f"--features-frac must be in [0, 1], got {frac}")
    names = [g for g in groups.split(",") if g]
    unknown = [g for g in names if g not in FEATURE_GROUPS]
    if unknown:
        raise SystemExit(f"--features: unknown {unknown}; known: {', '.join(FEATURE_GROUPS)}")
    fields = {k: FEATURES[k] for g in names for k in FEATURE_GROUPS[g]}
    return lambda i: fields if chosen(i, frac) else {}


def spec_options(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """LLM's speculative-decoding options (random runs as ngram, its proposer swapped after)."""
    algorithm = args.speculative_algorithm
    if algorithm is None:
        return {}
    options: dict[str, Any] = {
        "speculative_algorithm": "ngram" if algorithm in ("random", "oracle") else algorithm,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "speculative_max_backoff": args.speculative_max_backoff,
    }
    if algorithm == "standalone":
        options["speculative_draft_model_path"] = args.speculative_draft_model_path or model
    return options


def speculate(llm: Any, args: argparse.Namespace, runs: list[list[list[int]]], params: Any) -> Any:
    """For `--speculative-algorithm random`: swap in proposals of random ids (almost all
    rejected: what verifying costs when nothing is gained); for `oracle`: proposals of what
    decoding without them gives (from an untimed run of the same `runs` first; seeded
    sampling draws the same tokens), all accepted at no drafting cost (verification's gain).
    Returns a function that gives the result's speculation fields for the counts since it
    was made."""
    import random

    if args.speculative_algorithm is not None and args.dp > 1:
        raise SystemExit("--speculative-algorithm with --dp > 1: not measured by this script")
    if args.speculative_algorithm is None:  # (an A/B against an older tree: no ext/ there)
        return lambda: {"speculative": None}
    from minisgl.ext.spec.proposers import NgramProposer, room

    sched = llm.scheduler
    spec = sched.spec
    if args.speculative_algorithm == "random":
        rng, vocab = random.Random(0), llm.engine.model_config.vocab_size

        class RandomProposer(NgramProposer):
            def propose(self, req: Any) -> list[int]:
                return [rng.randrange(vocab) for _ in range(room(req, self.num_draft))]

        spec.proposer = RandomProposer(args.speculative_num_draft_tokens, 1, 1)
    if args.speculative_algorithm == "oracle":
        future = {}
        sched.spec = sched.planner.spec = sched.engine.speculator = None  # plain decoding
        for prompts in runs:
            for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
                future[tuple(prompt)] = out["token_ids"]
        sched.spec = sched.planner.spec = sched.engine.speculator = spec
        llm.reset_prefix_cache()  # the timed runs prefill their prompts again
        by_uid: dict[int, list[int]] = {}

        class OracleProposer(NgramProposer):
            def propose(self, req: Any) -> list[int]:
                if req.uid not in by_uid:
                    by_uid[req.uid] = future[tuple(req.tokens[: req.prompt_len])]
                done = req.num_output
                return by_uid[req.uid][done : done + room(req, self.num_draft)]

        spec.proposer = OracleProposer(args.speculative_num_draft_tokens, 1, 1)
    before = spec.num_draft_tokens, spec.num_accepted_tokens, spec.num_verified_rows

    def fields() -> dict[str, Any]:
        drafted, accepted, rows = (
            spec.num_draft_tokens - before[0],
            spec.num_accepted_tokens - before[1],
            spec.num_verified_rows - before[2],
        )
        return {
            "speculative": args.speculative_algorithm,
            "num_draft_tokens": args.speculative_num_draft_tokens,
            "max_backoff": args.speculative_max_backoff,
            "spec_draft_tokens": drafted,
            "spec_accepted_tokens": accepted,
            # tokens a verifying request-step yields: its accepted proposals and its own token
            "spec_accept_length": round(1 + accepted / rows, 3) if rows else None,
        }

    return fields


LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(model: str, count: int, rank: int, b_scale: float = 0.02) -> list[str]:
    """`count` random PEFT LoRA adapters of rank `rank` on every projection of the model in
    directory `model` (its config.json's shapes), written once (bf16 safetensors) to a temp
    directory removed at exit; -> their directories. A and B are both random (PEFT starts B at
    zero, which would make an adapter a no-op that a fast path could skip), small enough that
    the dummy model's activations stay finite (B's entries ~ `b_scale`)."""
    if count == 0:  # (nothing of ext/lora imported: an A/B against an older tree)
        return []
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from minisgl.ext.lora.adapter import module_shape
    from minisgl.models.config import ModelConfig

    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model))
    root = tempfile.mkdtemp(prefix="minisgl_bench_lora_")
    atexit.register(shutil.rmtree, root, True)
    paths = []
    for n in range(count):
        gen = torch.Generator().manual_seed(n)
        tensors = {}
        for layer in range(config.num_layers):
            for module in LORA_MODULES:
                fan_in, fan_out = module_shape(module, config)
                block = "mlp" if module in LORA_MODULES[4:] else "self_attn"
                name = f"base_model.model.model.layers.{layer}.{block}.{module}"
                a = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                b = torch.randn(fan_out, rank, generator=gen) * b_scale
                tensors[f"{name}.lora_A.weight"] = a.to(torch.bfloat16)
                tensors[f"{name}.lora_B.weight"] = b.to(torch.bfloat16)
        path = os.path.join(root, f"adapter{n}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        peft = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none"}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({**peft, "target_modules": list(LORA_MODULES)}, f)
        paths.append(path)
    return paths


def lora_options(args: argparse.Namespace, paths: list[str]) -> dict[str, Any]:
    """LLM's LoRA options serving the adapters at `paths` as bench0, bench1, ... from the start
    (every TP rank reads them), all resident on the device."""
    if not paths:
        return {}
    if args.dp > 1:
        raise SystemExit("--lora-adapters with --dp > 1: not measured by this script")
    if args.grammar_frac > 0:
        raise SystemExit("--lora-adapters with --grammar-frac: LoRA refuses constrained requests")
    return {
        "enable_lora": True,
        "lora_modules": [f"bench{n}={path}" for n, path in enumerate(paths)],
        "max_loras": len(paths),
        "max_lora_rank": args.lora_rank,
    }


def adapted(count: int) -> Any:
    """i -> the SamplingParams field naming request i's adapter: bench{i % count} (none when
    count is 0; --single's one request gets bench0)."""
    return lambda i: {"lora_name": f"bench{i % count}"} if count else {}


def commit() -> str | None:
    """The checkout's short HEAD, with "+dirty" when tracked files differ from it."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = ["git", "-C", here]
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            [*git, "diff", "--quiet", "HEAD", "--", "."], capture_output=True
        ).returncode
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def engine_args(p: argparse.ArgumentParser) -> None:
    """The engine options and the ablation switches."""
    p.add_argument("--device", default="auto")
    p.add_argument("--attn", default="auto")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (GPUs)")
    p.add_argument(
        "--dp",
        type=int,
        default=1,
        help="data-parallel replicas (LLM(dp=N): dp x tp GPUs; no roofline, no --profile)",
    )
    p.add_argument("--moe-backend", choices=["auto", "torch", "triton"], default="auto")
    p.add_argument("--cuda-graph-max-bs", type=int, default=256)
    p.add_argument(
        "--kv-cache-dtype",
        choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"],
        default="auto",
        help="KV pool type (the roofline then counts its bytes)",
    )
    p.add_argument("--page-size", type=int, help="tokens per KV page (default: LLM's, 16)")
    p.add_argument("--no-overlap", action="store_true", help="MINISGL_DISABLE_OVERLAP_SCHEDULING")
    p.add_argument("--no-fused", action="store_true", help="MINISGL_DISABLE_FUSED_OPS")
    p.add_argument("--no-gemv", action="store_true", help="MINISGL_DISABLE_GEMV")
    p.add_argument(
        "--gemv-max-m", type=int, help="MINISGL_GEMV_MAX_M: batches up to N rows take the GEMV"
    )
    p.add_argument("--no-pdl", action="store_true", help="MINISGL_DISABLE_PDL")
    p.add_argument(
        "--max-prefill-tokens", type=int, help="default: LLM's (8192; 32768 on >= 70 GiB)"
    )
    p.add_argument("--max-num-batched-tokens", type=int, help="a step's tokens (default: LLM's)")
    p.add_argument(
        "--disable-mixed-steps", action="store_true", help="decodes wait for prefill steps"
    )
    p.add_argument(
        "--disable-prefill-graphs",
        action="store_true",
        help="small prefill and mixed steps run eagerly instead of as decode-graph rows",
    )


def spec_args(p: argparse.ArgumentParser) -> None:
    """Speculative decoding, as the server's flags."""
    p.add_argument(
        "--speculative-algorithm",
        choices=["ngram", "standalone", "random", "oracle"],
        help="speculative decoding (as the server's flag); random: random proposals, nearly "
        "all rejected (verification's cost); oracle: the tokens decoding gives without "
        "speculation (an untimed run first), all accepted and free (verification's gain); "
        "standalone without --speculative-draft-model-path drafts with the target itself "
        "(dummy weights from the same seed: all accepted)",
    )
    p.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    p.add_argument(
        "--speculative-max-backoff",
        type=int,
        default=16,
        help="a request whose proposals gained nothing proposes at most every N-th step"
        " (0 or 1: at every step, none overlapped)",
    )
    p.add_argument("--speculative-draft-model-path", help="standalone's draft model")


def parse_args() -> argparse.Namespace:
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--model",
        "--config",
        dest="model",
        default=os.path.join(here, "..", "qwen3-0.6b"),
        help="model directory; with dummy weights a directory with only config.json will do "
        "(benchmark/qwen3-0.6b, qwen3-8b, qwen3-30b-a3b)",
    )
    p.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 (smoke test)")
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--single", action="store_true", help="one request: decode tok/s")
    engine_args(p)
    p.add_argument("--profile", action="store_true", help="print the top GPU kernels")
    p.add_argument(
        "--old-roofline",
        action="store_true",
        help="the roofline before 2026-12-01 (2 * params FLOPs a prompt token, no attention)",
    )
    p.add_argument(
        "--host-profile",
        action="store_true",
        help="print the host functions taking the most time (cProfile of the timed runs)",
    )
    p.add_argument(
        "--step-times",
        action="store_true",
        help="print each kind of step's host and GPU time and the GPU's idle between steps",
    )
    p.add_argument(
        "--log-compiles",
        action="store_true",
        help="print each Triton kernel variant compiled (or loaded from its disk cache) during"
        " the timed runs: a variant first met there stalls the run",
    )
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="time the workload this many times in one process; tok/s is the median run",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=24,
        help="short requests run before the clock (kernels compile at first use); 0: none"
        " (CPU smoke tests: nothing compiles there)",
    )
    p.add_argument(
        "--json",
        help="append the result as one JSON line to this file (with the date, commit, command"
        " and --note; with --profile the GPU's kernel time)",
    )
    p.add_argument("--note", help="a remark stored in the --json line (e.g. what was compared)")
    spec_args(p)
    p.add_argument(
        "--grammar-frac",
        type=float,
        default=0.0,
        help="fraction of requests constrained by a simple JSON schema (structured generation)",
    )
    p.add_argument(
        "--features-frac",
        type=float,
        default=0.0,
        help="fraction of requests with penalties, logit_bias and logprobs=5 (FEATURES)",
    )
    p.add_argument(
        "--features",
        default=",".join(FEATURE_GROUPS),
        help="which FEATURES the --features-frac requests use (comma-separated, an ablation)",
    )
    p.add_argument(
        "--lora-adapters",
        type=int,
        default=0,
        help="serve N random LoRA adapters (every projection) and run request i on adapter"
        " i %% N (--single: adapter 0); 0: no LoRA",
    )
    p.add_argument("--lora-rank", type=int, default=16, help="the --lora-adapters' rank")
    args = p.parse_args()
    if args.gemv_max_m is not None and not 1 <= args.gemv_max_m <= 64:
        p.error(f"--gemv-max-m {args.gemv_max_m}: the GEMV kernels take 1 to 64 rows")
    if args.warmup < 0:
        p.error(f"--warmup {args.warmup}: must be >= 0")
    if args.lora_adapters < 0 or args.lora_rank < 1:
        p.error("--lora-adapters must be >= 0 and --lora-rank >= 1")
    if args.step_times and args.dp > 1:  # each replica steps in its own process
        p.error("--step-times times this process's scheduler: one replica (--dp 1)")
    return args


ENV_SWITCHES = {
    "no_overlap": "MINISGL_DISABLE_OVERLAP_SCHEDULING",
    "no_fused": "MINISGL_DISABLE_FUSED_OPS",
    "no_gemv": "MINISGL_DISABLE_GEMV",
    "no_pdl": "MINISGL_DISABLE_PDL",
}


def set_env(args: argparse.Namespace) -> None:
    """The ablation switches that are environment flags, before minisgl imports."""
    for attr, name in ENV_SWITCHES.items():
        if getattr(args, attr):
            os.environ[name] = "1"
    if args.gemv_max_m is not None:
        os.environ["MINISGL_GEMV_MAX_M"] = str(args.gemv_max_m)


def make_llm(args: argparse.Namespace, model: str, lora_paths: list[str]) -> Any:
    from minisgl import LLM

    chunks = dict(
        max_prefill_tokens=args.max_prefill_tokens,
        max_num_batched_tokens=args.max_num_batched_tokens,
    )  # unset: LLM's defaults
    return LLM(
        model,
        dummy_weights=True,
        device=args.device,
        tp=args.tp,
        dp=args.dp,
        attn=args.attn,
        moe_backend=args.moe_backend,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        kv_cache_dtype=args.kv_cache_dtype,
        **{k: v for k, v in chunks.items() if v is not None},
        **({} if args.page_size is None else {"page_size": args.page_size}),
        disable_mixed_steps=args.disable_mixed_steps,
        disable_prefill_graphs=args.disable_prefill_graphs,
        **spec_options(args, model),
        **lora_options(args, lora_paths),
    )


def make_requests(llm: Any, args: argparse.Namespace) -> tuple[list, list[int], list]:
    """The workload's prompts, output lengths and sampling parameters; warms the engine up."""
    from minisgl import SamplingParams

    if args.single:
        prompts, _ = workload(1, 128, args.max_output_len)
        max_tokens = [args.max_output_len]
    else:
        prompts, max_tokens = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    grammar, features, lora = (
        constrain(llm, args.grammar_frac, args.tp),
        featured(args.features_frac, args.features),
        adapted(args.lora_adapters),
    )
    seeded = args.speculative_algorithm == "oracle"  # its untimed run draws the same tokens
    params = [
        SamplingParams(
            temperature=0.6,
            ignore_eos=True,
            max_tokens=n,
            seed=i if seeded else None,
            **grammar(i),
            **features(i),
            **lora(i),
        )
        for i, n in enumerate(max_tokens)
    ]
    # Warm-up: Triton compiles a kernel variant per argument pattern (an int divisible by 16 or
    # not, ...) on first use; varied prompt lengths and batch sizes meet them before the clock.
    if args.warmup > 0:
        warm_prompts = shifted(workload(args.warmup, 300, 100)[0], 5000)  # no prefix of the run
        warm_params = [
            SamplingParams(
                temperature=0.6, max_tokens=4 + i % 5, **grammar(i), **features(i), **lora(i)
            )
            for i in range(args.warmup)
        ]
        llm.generate(warm_prompts, warm_params, use_tqdm=False)
    return prompts, max_tokens, params


def log_compiles() -> list[str]:
    """A list that Triton's post-compile hook fills with "seconds: kernel[specialization]"
    (Triton 3.4 or later; an empty list elsewhere), from now on, in this process."""
    compiled: list[str] = []
    try:
        from triton import knobs
    except ImportError:
        return compiled
    start = time.perf_counter()

    def hook(*, repr: str, **_: Any) -> bool:
        compiled.append(f"{time.perf_counter() - start:7.2f} s: {repr[:300]}")
        return False

    knobs.runtime.jit_post_compile_hook = hook
    return compiled


def timed_runs(llm: Any, args: argparse.Namespace, prompts: list, params: list) -> dict[str, Any]:
    """Runs the workload --repeat times under the asked profilers: the runs' seconds, the last
    run's outputs, the prefix-cache hits, the kernel and busy times (--profile) and
    speculation's fields."""
    import torch

    profiler = None
    if args.profile and torch.cuda.is_available():
        from torch.profiler import ProfilerActivity, profile

        profiler = profile(activities=[ProfilerActivity.CUDA])
        profiler.__enter__()
    host_profiler = cProfile.Profile() if args.host_profile else None
    if host_profiler is not None:
        host_profiler.enable()
    sync = torch.cuda.synchronize if torch.cuda.is_available() else lambda: None
    # a repeat shifts every token id, so it finds nothing of the previous runs in the radix
    # cache (which would skip their prefill)
    run_prompts_each = [shifted(prompts, r) for r in range(max(1, args.repeat))]
    spec_fields = speculate(llm, args, run_prompts_each, params)
    compiled = log_compiles() if args.log_compiles else None
    runs, cached_before, steps = [], llm.num_cached_tokens, []
    for run_prompts in run_prompts_each:
        steps.append([])
        sync()
        start = time.perf_counter()
        with step_times.recorded(steps[-1]) if args.step_times else contextlib.nullcontext():
            outputs = llm.generate(run_prompts, params, use_tqdm=False)
        sync()
        runs.append(time.perf_counter() - start)
    if args.step_times:
        print("\n".join(step_times.summary(steps)))
    if compiled is not None:
        print(f"{len(compiled)} Triton kernel variants compiled or loaded during the timed runs")
        print("\n".join(compiled))
    if host_profiler is not None:
        host_profiler.disable()
        pstats.Stats(host_profiler).sort_stats("tottime").print_stats(30)
    kernel_s = busy_s = None
    if profiler is not None:
        from timeline import busy_by_slice, device_ops, idle_gaps, kernel_groups  # this directory

        profiler.__exit__(None, None, None)
        kernels = profiler.key_averages()
        print(kernels.table(sort_by="cuda_time_total", row_limit=20))
        # summed kernel times: two kernels that overlap under PDL both count
        kernel_s = sum(k.self_device_time_total for k in kernels) / 1e6
        ops = device_ops(profiler.profiler.kineto_results.events())
        busy_us, span_us, _ = idle_gaps(ops)
        busy_s = busy_us / 1e6
        print(f"GPU kernel time {kernel_s:.3f} s (summed) in {sum(runs):.3f} s; GPU busy "
              f"{busy_s:.3f} s ({busy_s / sum(runs):.1%}: the union of kernel and copy intervals)"
              f"; first kernel to last {span_us / 1e6:.3f} s")  # fmt: skip
        slices = busy_by_slice(ops)
        print("GPU busy by tenth of that span: " + ", ".join(f"{b:.0%} {k}" for b, k in slices))
        groups = kernel_groups({k.key: k.self_device_time_total / 1e6 for k in kernels})
        print("GPU time by kind: " + ", ".join(f"{kind} {t:.3f} s" for kind, t in groups))
    cached = llm.num_cached_tokens - cached_before
    return dict(
        runs=runs, outputs=outputs, cached=cached, kernel_s=kernel_s, busy_s=busy_s,
        spec=spec_fields(),
    )  # fmt: skip


def settings(args: argparse.Namespace) -> dict[str, Any]:
    """The --json line's record of how the engine ran."""
    return {
        "attn": args.attn,
        # speculation: the steps between proposals overlap (a back-off of 0 or 1 leaves none)
        "overlap": not args.no_overlap
        and (args.speculative_algorithm is None or args.speculative_max_backoff > 1),
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
        "kv_cache_dtype": args.kv_cache_dtype,
        "page_size": args.page_size,
        "mixed_steps": not args.disable_mixed_steps,
        "prefill_graphs": not args.disable_prefill_graphs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "fused": not args.no_fused,
        "gemv": not args.no_gemv,
        "gemv_max_m": args.gemv_max_m,
        "pdl": not args.no_pdl,
        "grammar_frac": args.grammar_frac,
        "features_frac": args.features_frac,
        "lora_adapters": args.lora_adapters,
        "lora_rank": args.lora_rank if args.lora_adapters else None,
        "warmup": args.warmup,
    }


def main() -> None:
    args = parse_args()
    set_env(args)
    import torch

    if args.dp > 1 and args.profile:
        raise SystemExit("--profile with --dp > 1: the kernels run in the replicas' processes")
    model = tiny_model_dir() if args.tiny else args.model
    llm = make_llm(args, model, write_adapters(model, args.lora_adapters, args.lora_rank))
    prompts, max_tokens, params = make_requests(llm, args)
    timed = timed_runs(llm, args, prompts, params)
    runs, outputs = timed["runs"], timed["outputs"]
    seconds = statistics.median(runs)
    total = sum(len(o["token_ids"]) for o in outputs)
    # a constrained request may end early, when its random text happens to close the JSON
    assert total == sum(max_tokens) or args.grammar_frac > 0, (total, sum(max_tokens))
    tok_s = total / seconds
    engine = getattr(llm, "engine", None)  # None with --dp > 1: the replicas hold theirs
    on_gpu = torch.cuda.is_available() and args.device != "cpu"
    gpu = torch.cuda.get_device_name(engine.device if engine else 0) if on_gpu else "cpu"
    moe = engine.model_config.moe if engine is not None else None
    result = {
        "gpu": gpu,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds")[:10],
        "commit": commit(),
        "command": shlex.join(["python", "benchmark/offline/bench.py", *sys.argv[1:]]),
        **({"note": args.note} if args.note else {}),
        "model": "tiny" if args.tiny else os.path.basename(os.path.normpath(args.model)),
        "tp": args.tp,
        "dp": args.dp,
        "requests": len(prompts),
        "output_tokens": total,
        "seconds": round(seconds, 3),
        "runs_s": [round(t, 3) for t in runs],
        "prefix_cached_tokens": timed["cached"],
        "tok_s": round(tok_s, 1),
        "moe_backend": moe.backend if moe is not None else None,
        **settings(args),
        "ended_by_grammar": sum(o["finish_reason"] == "stop" for o in outputs),
        **timed["spec"],
    }
    if engine is not None:  # the step budgets in effect (LLM's defaults where none was given)
        planner = llm.scheduler.planner
        result["max_prefill_tokens"] = planner.max_prefill_tokens
        result["max_num_batched_tokens"] = planner.max_batched_tokens
    if timed["kernel_s"] is not None:  # the summed kernel time over the timed runs' wall time
        result["gpu_kernel_s"] = round(timed["kernel_s"], 3)
        result["gpu_busy"] = round(timed["kernel_s"] / sum(runs), 3)
        # the union: the fraction of the wall time with nothing running on the GPU
        result["gpu_idle"] = round(1 - timed["busy_s"] / sum(runs), 4)
    if engine is not None and not args.single:
        result.update(roofline(engine, gpu, prompts, max_tokens, tok_s, args.tp, args.old_roofline))
    line = f"{gpu}: {total} tokens in {seconds:.2f} s = {tok_s:,.1f} tok/s" + (
        f" ({result['roofline_fraction']:.1%} of the {result['roofline_tok_s']:,.0f} tok/s"
        " roofline)"
        if "roofline_tok_s" in result
        else ""
    )
    print(line)
    print(json.dumps(result))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(result) + "\n")
    llm.shutdown()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
