"""Start-up choices that make CPU inference fast: the compute dtype (bf16 where the CPU has
bf16 instructions), weight-only quantization (`--quantization`) and the thread count."""

from __future__ import annotations

import functools
import os
import sys

import torch

from minisgl import env
from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.models.gguf_quant import QUANTIZED_FILE
from minisgl.utils.options import OptionError

# /proc/cpuinfo flags of x86 CPUs that compute bf16 dot products natively
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_bf16_flag() -> str | None:
    """The first of BF16_FLAGS this CPU has, or None (also off Linux)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return next((flag for flag in BF16_FLAGS if flag in flags), None)
    except OSError:
        pass
    return None


def has_gguf_blocks(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, QUANTIZED_FILE))


def cpu_auto_dtype(quantization: str, model_dir: str, tp_size: int) -> torch.dtype:
    """`--dtype auto` on CPU: bfloat16 when the weights will be quantized (the kernels are fast
    only in 16 bits) and the CPU has bf16 instructions; float32 otherwise (the exact path, and
    faster than bf16 for dense decode). MINISGL_CPU_FLOAT32=1 keeps float32."""
    if env.cpu_float32() or cpu_bf16_flag() is None or quantization == "none":
        return torch.float32
    if quantization == "auto" and (tp_size != 1 or not has_gguf_blocks(model_dir)):
        return torch.float32
    return torch.bfloat16


def resolve_quantization(
    mode: str, device: torch.device, dtype: torch.dtype, model_dir: str, tp_size: int
) -> str:
    """`--quantization` -> none / gguf / int8. auto: gguf for a GGUF model with quantized
    tensors on CPU in a 16-bit dtype at TP 1, else none (never on CUDA). An explicit mode that
    cannot run raises ValueError naming the flag."""
    has_blocks = has_gguf_blocks(model_dir)
    fast = device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and tp_size == 1
    if mode == "auto":
        return "gguf" if fast and has_blocks else "none"
    if mode == "none":
        return mode
    why = None
    if device.type != "cpu":
        why = "its kernels are CPU-only"
    elif dtype not in (torch.bfloat16, torch.float16):
        why = "it needs --dtype bfloat16 (the int4/int8 kernels are very slow in float32)"
    elif tp_size != 1:
        why = "it does not support --tp above 1"
    elif mode == "gguf" and not has_blocks:
        why = "the model is not a GGUF file with Q4_0, Q4_1 or Q8_0 tensors"
    if why is not None:
        raise ValueError(f"--quantization {mode}: {why}")
    return mode


def check_torch_compile(device: torch.device, tp_size: int, moe: bool) -> None:
    """--enable-torch-compile runs where one graph can hold the decoder: OptionError else."""
    why = None
    if device.type != "cpu":
        why = "it is for cpu (on cuda, decode steps replay CUDA graphs)"
    elif tp_size != 1:
        why = "it needs --tp 1 (the all-reduce would split the graph)"
    elif moe:
        why = "MoE models pick their experts on the host: nothing a graph can hold"
    if why is not None:
        raise OptionError("enable_torch_compile", f"--enable-torch-compile: {why}")


def compile_decoder(decoder: torch.nn.Module) -> torch.nn.Module:
    """The decoder for one-request decode steps, compiled at its first call (batches stay
    eager: a second request never stalls the server with a compile). Only the KV length is
    dynamic (the attention backend marks it: one graph for every step); dynamic=True would
    make every weight's shape symbolic too: 85 s to compile on 2 cores instead of 30, and the
    cached graph's thousands of shape guards cost 40 s to check at the next start (9 s now)."""
    return torch.compile(decoder, fullgraph=True)  # type: ignore[return-value]


def mark_kv_len_dynamic(backend: BaseAttnBackend) -> None:
    """Have the attention backend mark the KV length dynamic for the compiled decoder; only
    the torch backend runs on CPU (OptionError for another, e.g. --attn triton)."""
    if not isinstance(backend, TorchAttnBackend):
        raise OptionError(
            "enable_torch_compile", "--enable-torch-compile: it needs the torch attention backend"
        )
    backend.dynamic_kv_len = True


def set_cpu_threads() -> int:
    """Use every core this process may run on (its affinity mask, which containers and
    `taskset` narrow), unless OMP_NUM_THREADS chose already."""
    if "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))
    return torch.get_num_threads()


def announce(dtype: torch.dtype, quantization: str, layers: int, compiled: bool) -> None:
    flag = cpu_bf16_flag()
    why = f" ({flag})" if dtype == torch.bfloat16 and flag else ""
    quant = f", {layers} projections quantized ({quantization})" if layers else ""
    compile_note = ", decode compiled (torch.compile: the first decode step waits)"
    print(
        f"minisgl: cpu, {str(dtype).removeprefix('torch.')}{why}, "
        f"{torch.get_num_threads()} threads{quant}{compile_note if compiled else ''}",
        file=sys.stderr,
    )
