"""The cpu extension's start-up policy: the compute dtype (bf16 where the CPU has bf16
instructions and the weights are quantized), the `--quantization` rule, and the start line. The
core alone computes in float32 on CPU, its exact path."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import torch

from minisgl import env
from minisgl.distributed import get_tp_info
from minisgl.engine.config import config_model_path
from minisgl.ext.cpu.gguf import BLOCKS_FILE
from minisgl.ext.cpu.native import cpu_flags, native_kernel
from minisgl.ext.cpu.options import cpu_options

# /proc/cpuinfo flags of x86 CPUs that compute bf16 dot products natively
BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_bf16_flag() -> str | None:
    """The first of BF16_FLAGS this CPU has, or None (also off Linux)."""
    return next((flag for flag in BF16_FLAGS if flag in cpu_flags()), None)


def has_gguf_blocks(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, BLOCKS_FILE))


def cpu_auto_dtype(
    quantization: str, model_dir: str | Callable[[], str], tp_size: int
) -> torch.dtype:
    """`--dtype auto` on CPU: bfloat16 when the weights will be quantized (the kernels are fast
    only in 16 bits) and the CPU has bf16 instructions, or without them a GGUF's blocks on
    minisgl's own kernel (`native.py`; prompts' GEMMs then run in float32: `quantized.py`);
    float32 otherwise (the exact path, and faster than bf16 for dense decode).
    MINISGL_CPU_FLOAT32=1 keeps float32. `model_dir` may be a function, called only when the
    model's GGUF blocks decide."""
    if env.flag("MINISGL_CPU_FLOAT32") or quantization == "none":
        return torch.float32
    bf16 = cpu_bf16_flag() is not None
    if bf16 and quantization != "auto":  # asked for: its kernels are fast in 16 bits here
        return torch.bfloat16
    # a GGUF's quantized tensors at TP 1; without bf16 instructions only on minisgl's kernel
    if tp_size != 1 or quantization == "int8" or not (bf16 or native_kernel()):
        return torch.float32
    directory = model_dir if isinstance(model_dir, str) else model_dir()
    return torch.bfloat16 if has_gguf_blocks(directory) else torch.float32


def auto_dtype(config: Any) -> str:
    """What --dtype auto means for an EngineConfig on cpu at this process's TP size (the name of
    `cpu_auto_dtype`'s: "float32" or "bfloat16"), for `options.engine_options`."""
    model_dir = functools.partial(config_model_path, config)
    dtype = cpu_auto_dtype(cpu_options(config).quantization, model_dir, get_tp_info().size)
    return str(dtype).removeprefix("torch.")


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
        why = "the model is not a GGUF file with Q4_0/1, Q5_0/1, Q8_0 or Q4/5/6_K tensors"
    if why is not None:
        raise ValueError(f"--quantization {mode}: {why}")
    return mode


def announce(
    dtype: torch.dtype, quantization: str, layers: int, compiled: bool, entry: str | None = None
) -> None:
    """The start line on stderr: what this CPU engine computes with, how fast it can, and the
    cache entry (a GGUF's conversion, with its size) its weights come from."""
    flag = cpu_bf16_flag()
    why = f" ({flag})" if dtype == torch.bfloat16 and flag else ""
    quant = f", {layers} projections quantized ({quantization})" if layers else ""
    compile_note = ", decode compiled (torch.compile: the first decode step waits)"
    print(
        f"minisgl: cpu, {str(dtype).removeprefix('torch.')}{why}, "
        f"{torch.get_num_threads()} threads{quant}{compile_note if compiled else ''}"
        f"{f', weights from {entry}' if entry else ''}",
        file=sys.stderr,
    )
