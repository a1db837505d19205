"""The cpu extension's options (the `scheduler_options` point): flags of `python -m minisgl`
listed under "cpu extension", keywords of `LLM(...)`. `engine_options` (the `engine_config`
point) hands them to the engine each scheduler builds, as `EngineConfig.extras["cpu"]`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from minisgl.utils.device import device_type
from minisgl.utils.options import check_options, int_range, option

QUANTIZATIONS = ("auto", "none", "gguf", "int8")
COMPILES = ("auto", "aot", "off")


@dataclass
class CpuOptions:
    quantization: str = option(
        "auto",
        "weight-only quantized linear layers (CPU, 16-bit dtype, TP 1): gguf (a GGUF's Q4_0/1, "
        "Q4_K codes as int4, Q5_0/1, Q5_K, Q8_0 as int8), int8 (every projection per row), "
        "none (dequantized: the exact path); auto: gguf for a quantized GGUF in bfloat16, else "
        "none",
        choices=QUANTIZATIONS,
    )
    enable_torch_compile: bool = option(
        False,
        "cpu: compile one-request decode steps with torch.compile at run time (a compile of "
        "~30 s at the first, ~10 s at every start); batches stay eager; wins over --cpu-compile",
    )
    cpu_compile: str = option(
        "auto",
        "cpu: aot: decode steps (one request's, a batch's) run decoder layers compiled ahead "
        "of time (AOTInductor; decode ~1.5x eager), each kind built once at a model's first "
        "start (~7 s on 2 cores) and kept in the cache, eager if it cannot be built or "
        "loaded; auto: aot for a quantized model, batches only for a dense one (one request's "
        "steps on the exact float32 path stay eager); off (or MINISGL_CPU_AOT=0): eager",
        choices=COMPILES,
    )

    cpu_threads: int = option(
        0,
        "cpu: intra-op threads of the engine; 0 (auto): OMP_NUM_THREADS if set, else decode "
        "steps move between every core and one, whichever is measurably faster (a busy core "
        "stalls threads that wait for each other), prompts on every core",
        type=int_range(0),
    )

    def __post_init__(self) -> None:
        check_options(self)


def cpu_options(config: Any) -> CpuOptions:
    """An EngineConfig's or a SchedulerConfig's cpu options (the defaults when unset)."""
    options = config.extras.get("cpu")
    return options if isinstance(options, CpuOptions) else CpuOptions()


def engine_options(config: Any, sched: Any) -> Any:
    """The `engine_config` point: `config` with the scheduler's cpu options and, on cpu, what its
    --dtype auto means (`policy.auto_dtype`; the core's is float32)."""
    config = dataclasses.replace(config, extras={**config.extras, "cpu": cpu_options(sched)})
    if config.dtype != "auto" or device_type(config.device) != "cpu":
        return config
    from minisgl.ext.cpu.policy import auto_dtype  # torch: only the schedulers get here

    return dataclasses.replace(config, dtype=auto_dtype(config))
