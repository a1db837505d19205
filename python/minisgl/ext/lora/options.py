"""The LoRA extension's options, named as vLLM names them (SGLang's --lora-paths as an alias):
the `scheduler_options` point, so they are flags of `python -m minisgl` listed under "lora
extension", keywords of `LLM(...)`, and `SchedulerConfig.extras["lora"]` in every scheduler
process (each TP rank builds its own adapter slots)."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from minisgl.utils.options import OptionError, check_options, int_range, option


@dataclass(frozen=True)
class LoraModule:
    """An adapter served under `name` (the `model` of a request), read from `path` (a
    directory or a hub id); `base_model_name`: the model /v1/models lists as its parent."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(value: str) -> LoraModule:
    """vLLM's --lora-modules forms: NAME=PATH, or the JSON object
    {"name": ..., "path": ..., "base_model_name": ...}."""
    if value.lstrip().startswith("{"):
        try:
            spec = json.loads(value)
        except ValueError as e:
            message = f"invalid JSON in lora_modules {value!r}: {e}"
            raise OptionError("lora_modules", message) from None
        if not isinstance(spec, dict) or set(spec) - {"name", "path", "base_model_name"}:
            raise OptionError(
                "lora_modules", f"lora_modules {value!r}: expected keys name, path, base_model_name"
            )
        name, path, base = spec.get("name"), spec.get("path"), spec.get("base_model_name")
    else:
        name, _, path = value.partition("=")
        base = None
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise OptionError("lora_modules", f"lora_modules {value!r}: expected NAME=PATH")
    if base is not None and not isinstance(base, str):
        raise OptionError("lora_modules", f"lora_modules {value!r}: base_model_name not a string")
    return LoraModule(name, path, base)


@dataclass
class LoraOptions:
    enable_lora: bool = option(False, "serve LoRA adapters (PEFT format) beside the base model")
    lora_modules: tuple[str, ...] = option(
        (),
        "adapters served at start: NAME=PATH or a JSON object with name, path and "
        "base_model_name (PATH: a directory or a Hugging Face hub id)",
        nargs="+",
        metavar="NAME=PATH",
        aliases=["--lora-paths"],
    )
    max_loras: int = option(1, "adapters resident on the device at once", type=int_range(1))
    max_cpu_loras: int | None = option(
        None, "adapters kept in host memory (default: max_loras; at least it)", type=int_range(1)
    )
    max_lora_rank: int = option(64, "the largest adapter rank accepted", type=int_range(1))

    def modules(self) -> list[LoraModule]:
        """--lora-modules parsed; OptionError for a bad entry or a name given twice."""
        parsed = [parse_lora_module(v) for v in self.lora_modules]
        names = [m.name for m in parsed]
        if dup := sorted({n for n in names if names.count(n) > 1}):
            raise OptionError("lora_modules", f"lora_modules names {dup} given more than once")
        return parsed

    @property
    def cpu_loras(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    def __post_init__(self) -> None:
        check_options(self)
        self.check()

    def check(self) -> None:
        """The options against each other: OptionError naming the option."""
        if self.lora_modules and not self.enable_lora:
            raise OptionError("lora_modules", "lora_modules needs enable_lora")
        if self.cpu_loras < self.max_loras:
            message = f"max_cpu_loras ({self.cpu_loras}) must be >= max_loras ({self.max_loras})"
            raise OptionError("max_cpu_loras", message)
        self.modules()

    def resolve_models(self) -> LoraOptions:
        """The launcher, once, before any scheduler starts: the adapters downloaded (hub ids) and
        read, so that a bad one fails the start naming its flag (--max-lora-rank for a rank over
        it, else --lora-modules); -> the options with local paths."""
        if not (modules := self.modules()):  # the adapters' module imports torch: only for some
            return dataclasses.replace(self, lora_modules=())
        from minisgl.ext.lora.adapter import AdapterError, RankTooLarge, inspect_adapter

        resolved = []
        for m in modules:
            try:
                path = inspect_adapter(m.name, m.path, self.max_lora_rank)
            except RankTooLarge as e:
                raise OptionError("max_lora_rank", str(e)) from None
            except AdapterError as e:
                raise OptionError("lora_modules", str(e)) from None
            spec = {"name": m.name, "path": path, "base_model_name": m.base_model_name}
            resolved.append(json.dumps(spec))
        return dataclasses.replace(self, lora_modules=tuple(resolved))


def lora_options(config: Any) -> LoraOptions:
    """A SchedulerConfig's LoRA options (the defaults, off, when unset)."""
    options = config.extras.get("lora")
    return options if isinstance(options, LoraOptions) else LoraOptions()
