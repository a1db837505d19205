"""Multi-LoRA serving (issue 48): PEFT adapters beside the base model, requests for the base
and for several adapters mixed in every batch.

- `options.py`: the flags, as vLLM's (`scheduler_options`: --enable-lora, --lora-modules,
  --max-loras, --max-cpu-loras, --max-lora-rank; SGLang's --lora-paths);
- `adapter.py`: PEFT adapters read from a directory or a hub id, checked against the model,
  mapped onto minisgl's merged projections;
- `weights.py`: the adapters' stacked weights in device slots (sharded like each layer), and
  the slots' manager (LRU eviction of idle adapters to a bounded host cache, pins);
- `layers.py`: the LoRA computation of a projection (torch reference; the kernel's entry
  point) and the model transform that installs it (`model_transform`), each token reading its
  adapter slot by its page-table row;
- `kernel.py`: the Triton kernel (shrink / expand over token tiles per slot) for CUDA;
- `manager.py`: the served adapters by name;
- `feature.py`: the step feature (a request's adapter in `Req.ext`, its slot pinned while it
  runs, the prefix cache's namespace), the offline `lora_request` (`LoRARequest`).
- `http.py`: the server's side: a request's `model` (`ApiServer.adapters`), or /generate's
  `lora_path` / `lora_name` (`request_fields`), names an adapter; /v1/models lists them."""

from __future__ import annotations

from minisgl.core import SamplingParams
from minisgl.ext.lazy import Lazy
from minisgl.ext.lora.feature import (
    EngineOptions,
    LoRARequest,
    make_feature,
    offline_lora,
    wrap_transform,
)
from minisgl.ext.lora.http import LoraFields, served_adapters
from minisgl.ext.lora.options import LoraOptions
from minisgl.ext.lora.runtime import LoraChange, LoraUpdateRequest, follow_change, handle_update
from minisgl.extension import extensions

__all__ = ["LoRARequest", "LoraOptions", "served_adapters"]


def check_lora_name(params: SamplingParams) -> None:
    """The `sampling_params` check of `lora_name` (whether it is served: the scheduler's)."""
    name = params.get("lora_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"lora_name must be a non-empty string, got {name!r}")


_points = extensions()
_points.scheduler_options["lora"] = LoraOptions
_points.sampling_params["lora_name"] = check_lora_name
_points.engine_config.append(EngineOptions.keep)
_points.model_transform = wrap_transform(_points.model_transform)  # around the cpu one
_points.step_features.append(make_feature)
_points.lora_request = offline_lora
# the adapters served (ApiServer.adapters); /v1/load_lora_adapter, /v1/unload_lora_adapter (the
# API process's: fastapi, imported there)
_points.routes.append(Lazy("minisgl.ext.lora.routes", "add_lora_routes"))
_points.scheduler_messages[LoraUpdateRequest] = handle_update
_points.tp_changes[LoraChange] = follow_change
for _path in ("/v1/completions", "/v1/chat/completions", "/generate"):
    _points.request_fields.setdefault(_path, []).append(LoraFields)
