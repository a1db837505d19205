"""The LoRA extension's HTTP side: the adapters the API server serves (`ApiServer.adapters`: a
request's `model` names one, /v1/models lists them) and the body fields that name one
(`request_fields`: SGLang's `lora_path`, at /generate's top level or in its sampling_params,
and `lora_name`); `serve`: the runtime loads and unloads (`routes.py`) update both."""

from __future__ import annotations

from typing import Any

from minisgl.ext.lora.options import lora_options
from minisgl.server.protocol import APIError, ExtensionFields

# the adapters this API process serves (set with `served_adapters`; None: not known here)
_served: set[str] | None = None


def served_adapters(args: Any) -> dict[str, dict[str, Any]]:
    """The adapters of --lora-modules, with vLLM's card fields (`ApiServer.adapters`)."""
    global _served
    options = lora_options(args.scheduler)
    base = args.served_model_name or args.engine.model
    modules = options.modules() if options.enable_lora else []
    _served = {m.name for m in modules}
    return {m.name: {"root": m.path, "parent": m.base_model_name or base} for m in modules}


def serve(name: str, fields: dict[str, Any] | None, api: Any) -> None:
    """Adapter `name` loaded (with its /v1/models card's `fields`) or, None, unloaded at run
    time (`routes.py`): a request's `model` and /v1/models follow in this API process."""
    global _served
    _served = _served if _served is not None else set()
    if fields is None:
        _served.discard(name)
        api.adapters.pop(name, None)
    else:
        _served.add(name)
        api.adapters[name] = fields


class LoraFields(ExtensionFields):
    lora_path: str | None = None  # SGLang's name: the adapter's name
    lora_name: str | None = None

    def params(self, req: Any) -> dict[str, Any]:
        """{"lora_name": the adapter} when the request's `model` (the API server 404s one not
        served) or these fields name one: 404 naming the field for one that is not served, 400
        when two name different ones."""
        given = {k: v for k, v in self.model_dump().items() if v is not None}
        if _served is not None and req.model in _served:
            given = {"model": req.model, **given}
        if len(set(given.values())) > 1:
            message = f"{' and '.join(given)} name different adapters"
            raise APIError(400, message, "lora_path" if "lora_path" in given else "lora_name")
        for field, name in given.items():
            if _served is not None and name not in _served:
                served = ", ".join(sorted(_served)) or "none"
                message = f"{field} {name!r}: no such LoRA adapter (served: {served})"
                raise APIError(404, message, field, "model_not_found")
        return {"lora_name": next(iter(given.values()))} if given else {}
