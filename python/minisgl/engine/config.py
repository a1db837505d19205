from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention import parse_attn
from minisgl.kernel import resolve_moe_backend
from minisgl.utils.device import device_type


@dataclass
class EngineConfig:
    model: str  # a directory, a .gguf file or a hub id
    device: str = "auto"  # auto | cuda | cpu (| cuda:N)
    dtype: str = "auto"  # auto: the checkpoint's dtype on CUDA (bf16 if float32), float32 on CPU
    kv_cache_dtype: str = "auto"  # auto: the model's dtype; fp8_e4m3 | fp8_e5m2 halve the KV bytes
    page_size: int = 16
    max_running_requests: int = 256
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    num_pages: int | None = None  # KV pool size; default from memory_ratio (GPU) or cpu_kv_cache_mb
    memory_ratio: float = 0.9  # fraction of free GPU memory (after weights) for the KV pool
    cpu_kv_cache_mb: int = 512
    attn: str = "auto"
    moe_backend: str = "auto"  # auto | torch | triton (kernel/moe.py); for MoE models only
    cuda_graph_max_bs: int = 256  # decode batches up to this size replay CUDA graphs; 0: off
    dummy_weights: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        checks = {
            "page_size": self.page_size >= 1,
            "max_running_requests": self.max_running_requests >= 1,
            "max_model_len": self.max_model_len is None or self.max_model_len >= 2,
            "num_pages": self.num_pages is None or self.num_pages >= 1,
            "memory_ratio": 0.0 < self.memory_ratio <= 1.0,
            "cpu_kv_cache_mb": self.cpu_kv_cache_mb >= 1,
            "cuda_graph_max_bs": self.cuda_graph_max_bs >= 0,
        }
        for name, ok in checks.items():
            if not ok:
                raise ValueError(f"invalid {name}: {getattr(self, name)!r}")
        if self.device.split(":")[0] not in ("auto", "cuda", "cpu"):
            raise ValueError(f"invalid device {self.device!r}: expected auto, cuda or cpu")
        parse_attn(self.attn)  # a bad name fails before the model loads
        resolve_moe_backend(self.moe_backend, device_type(self.device))  # before any process starts
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"invalid dtype {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"invalid kv_cache_dtype {self.kv_cache_dtype!r}: expected one of "
                + ", ".join(KV_CACHE_DTYPES)
            )


# --kv-cache-dtype: the pool stores K and V in this type (no scales: values are cast as they
# are, like vLLM's fp8 cache without calibration) and the kernels widen them on load
KV_CACHE_DTYPES = {
    "auto": None,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
