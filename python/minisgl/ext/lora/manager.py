"""The adapters an engine serves: names -> paths, read and checked against the model, placed in
device slots by a `SlotManager` over the transform's `LoraStack`. The integration calls
`acquire` when it admits a request for an adapter (its slot goes into the step's slot
indices), `release` when the request ends, `add` / `remove` for vLLM's load / unload routes."""

from __future__ import annotations

from minisgl.ext.lora.adapter import AdapterError, LoraAdapter, load_adapter
from minisgl.ext.lora.options import LoraOptions
from minisgl.ext.lora.weights import LoraStack, SlotManager
from minisgl.models.config import ModelConfig


class LoraManager:
    def __init__(self, options: LoraOptions, model: ModelConfig, stack: LoraStack) -> None:
        if stack.max_loras != options.max_loras or stack.max_rank != options.max_lora_rank:
            raise ValueError("the LoRA stack was built for other max_loras / max_lora_rank")
        options.check()
        self.model, self.max_rank = model, options.max_lora_rank
        self.paths: dict[str, str] = {}
        self.slots: SlotManager[LoraAdapter] = SlotManager(
            options.max_loras, options.cpu_loras, self._load, stack.write
        )
        for module in options.modules():
            self.add(module.name, module.path)

    def add(self, name: str, path: str) -> None:
        """Serve the adapter at `path` as `name`: read and checked now (AdapterError, nothing
        changed), kept in the host cache."""
        if name in self.paths:
            raise AdapterError(f"LoRA adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.model, self.max_rank)
        self.paths[name] = path
        self.slots.preload(name, adapter)

    def remove(self, name: str) -> None:
        """Stop serving `name` (AdapterInUse while requests use it)."""
        self._known(name)
        self.slots.remove(name)
        del self.paths[name]

    def acquire(self, name: str) -> int:
        """A request for `name` starts: its slot (SlotsBusy: every slot is in use)."""
        self._known(name)
        return self.slots.acquire(name)

    def release(self, name: str) -> None:
        self.slots.release(name)

    def _known(self, name: str) -> None:
        if name not in self.paths:
            known = ", ".join(sorted(self.paths)) or "none"
            raise AdapterError(f"unknown LoRA adapter {name!r} (loaded: {known})")

    def _load(self, name: str) -> LoraAdapter:
        return load_adapter(name, self.paths[name], self.model, self.max_rank)
