"""`--enable-torch-compile`: one-request decode steps on CPU run the decoder compiled by
torch.compile (fused C++ kernels instead of ~60 eager ops a layer); batches stay eager. Through
the `decoder_transform` point (`speed.cpu_engine`), which `Engine.decoder(batch)` hands decode
steps."""

from __future__ import annotations

from typing import Any

import torch

from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.torch_backend import TorchAttnBackend, TorchAttnMetadata
from minisgl.core import Batch
from minisgl.distributed import get_tp_info
from minisgl.ext.cpu.aot import aot_decoder
from minisgl.ext.cpu.options import cpu_options
from minisgl.utils.options import OptionError


def compiled_decoder(engine: Any) -> torch.nn.Module | None:
    """For the `decoder_transform` point: under --enable-torch-compile the built engine's
    (`engine.Engine`) decoder, compiled, once the checks pass and its attention backend marks
    the KV length dynamic; else the step compiled ahead of time (`aot.aot_decoder`), or
    None."""
    if not cpu_options(engine.config).enable_torch_compile:
        return aot_decoder(engine)
    moe = engine.model_config.moe is not None
    check_torch_compile(engine.device, get_tp_info().size, moe)
    mark_kv_len_dynamic(engine.attn_backend)
    return compile_decoder(engine.model.model)


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
    """The decoder for one-request decode steps, compiled at its first call."""
    return OneRequestCompiled(decoder)


class OneRequestCompiled(torch.nn.Module):
    """The decoder compiled for one-request steps; batches run it eagerly (a second request
    never stalls the server with a compile). Only the KV length is dynamic (the attention
    backend marks it: one graph for every step); dynamic=True would make every weight's shape
    symbolic too: 85 s to compile on 2 cores instead of 30, and the cached graph's thousands
    of shape guards cost 40 s to check at the next start (9 s now)."""

    holds_thread_count = True  # its graph guards on it (the thread governor leaves it)

    def __init__(self, decoder: torch.nn.Module) -> None:
        super().__init__()
        self.decoder = decoder
        self.compiled = torch.compile(decoder, fullgraph=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        run = self.compiled if input_ids.shape[0] == 1 else self.decoder
        return run(input_ids, positions)  # type: ignore[no-any-return]


def mark_kv_len_dynamic(backend: BaseAttnBackend) -> None:
    """Have the attention backend mark the KV length dynamic for the compiled decoder; only
    the torch backend runs on CPU (OptionError for another, e.g. --attn triton)."""
    if not isinstance(backend, TorchAttnBackend):
        raise OptionError(
            "enable_torch_compile", "--enable-torch-compile: it needs the torch attention backend"
        )
    prepare = backend.prepare

    def prepare_dynamic(batch: Batch) -> None:
        prepare(batch)
        torch._dynamo.maybe_mark_dynamic(TorchAttnMetadata.of(batch).kv_slots, 1)

    backend.prepare = prepare_dynamic  # type: ignore[method-assign]
