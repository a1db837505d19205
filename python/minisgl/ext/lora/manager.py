"""The adapters an engine serves: names -> paths, read and checked against the model, placed in
device slots by a `SlotManager` over the transform's `LoraStack`. The step feature
(`feature.py`) calls `acquire` when a request for an adapter may run (its slot goes into its
page-table row's slot index), `release` when the request ends; `add` / `remove` serve an
adapter from then on or stop (offline `lora_request`s). Each load of an adapter gets a new
id, the prefix cache's namespace of its requests: KV computed under one adapter (or under an
earlier adapter of the same name) is never another's."""

from __future__ import annotations

import itertools

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
        self.ids: dict[str, int] = {}  # name -> the id of its load (0: the base model's)
        self._next_id = itertools.count(1)
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
        self.paths[name], self.ids[name] = path, next(self._next_id)
        self.slots.preload(name, adapter)

    def remove(self, name: str) -> None:
        """Stop serving `name` (AdapterInUse while requests use it)."""
        self._known(name)
        self.slots.remove(name)
        del self.paths[name], self.ids[name]

    def id_of(self, name: str) -> int:
        """The id of the adapter served as `name` now (AdapterError: none is)."""
        self._known(name)
        return self.ids[name]

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
