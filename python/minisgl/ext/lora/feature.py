"""Requests on LoRA adapters: the step feature that gives each request its adapter's slot, the
engine's transform built from the scheduler's options, and the offline `lora_request`.

A request names its adapter by SamplingParams' `lora_name` (the server sets it from `model` or
/generate's `lora_path`; `LLM.generate` from a `LoRARequest`). `LoraFeature.request` checks
the name and keeps the choice in `req.ext["lora"]`. Every such request is held before
admission until its adapter has a device slot (`poll`, rank 0, in arrival order: a request
whose adapter finds every slot in use waits, and so do those behind it, so none starves);
the slot stays pinned until the request ends (`finished`), across preemptions. Each request
given a page-table row writes its slot there (`admitted`; 0 for the base model), which the
forward reads per token (`layers.py`). TP followers pin at admission, at rank 0's word: they
pin the same adapters in the same order, so a slot is free for them whenever it was for rank
0. The prefix cache keys a request's KV by its adapter's load id (`cache_namespace`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from minisgl.core import CONSTRAINT_KINDS, Req, SamplingParams
from minisgl.ext.held import Holding
from minisgl.ext.lora.options import LoraOptions, lora_options
from minisgl.extension import ModelTransform, StepFeature

# The adapters' modules (torch) are imported where a scheduler or an engine uses them: the
# package registers this module in processes without torch (tokenizer, detokenizer, API).
if TYPE_CHECKING:
    from minisgl.ext.lora.layers import LoraModelTransform

NAME = "lora"


@dataclass
class LoraChoice:
    """A request's adapter (`req.ext["lora"]`)."""

    name: str
    namespace: int  # the id of the adapter's load: the prefix cache's namespace
    slot: int | None = None  # its device slot while pinned


class LoraFeature(Holding):
    name = NAME

    def __init__(self, scheduler: Any, transform: LoraModelTransform, options: LoraOptions):
        from minisgl.ext.lora.manager import LoraManager

        super().__init__(scheduler)  # each request held until its adapter has a slot (`poll`)
        assert transform.stack is not None  # built with the model
        self.transform = transform
        self.manager = LoraManager(options, scheduler.engine.model_config, transform.stack)
        self.follower = scheduler.follower  # pins at admission, at rank 0's word

    def request(self, req: Req) -> None:
        name = req.params.get("lora_name")
        if name is None:
            return
        namespace = self.manager.id_of(name)  # AdapterError (a ValueError): not served
        if constraint := next((k for k in CONSTRAINT_KINDS if k in req.params.ext), None):
            # a grammar holds the request too, and may release it before its adapter has a slot
            raise ValueError(f"{constraint} with a LoRA adapter ({name!r}) is not supported yet")
        req.ext[NAME] = LoraChoice(name, namespace)

    def poll(self, held: list[Req]) -> tuple[list[Req], list[tuple[Req, str]]]:
        from minisgl.ext.lora.adapter import AdapterError
        from minisgl.ext.lora.weights import SlotsBusy

        ready: list[Req] = []
        failed: list[tuple[Req, str]] = []
        for req in held:
            try:
                self._pin(req)
            except SlotsBusy:
                break  # arrival order: the ones behind wait too
            except AdapterError as e:  # unloaded meanwhile, or no longer readable
                failed.append((req, str(e)))
                continue
            ready.append(req)
        return ready, failed

    def admitted(self, req: Req) -> None:
        choice = req.ext.get(NAME)
        if choice is not None and choice.slot is None:  # a TP follower's
            self._pin(req)
        self.transform.set_row(req.table_idx, choice.slot if choice is not None else 0)

    def finished(self, req: Req) -> None:
        super().finished(req)
        choice = req.ext[NAME]
        if choice.slot is not None:
            self.manager.release(choice.name)
            choice.slot = None

    def cache_namespace(self, req: Req) -> int:
        return req.ext[NAME].namespace

    def _pin(self, req: Req) -> None:
        from minisgl.ext.lora.adapter import AdapterError

        choice = req.ext[NAME]
        if self.manager.ids.get(choice.name) != choice.namespace:
            raise AdapterError(f"LoRA adapter {choice.name!r} was unloaded")
        choice.slot = self.manager.acquire(choice.name)


class LoraOff(StepFeature):
    """Without --enable-lora: a request that names an adapter is refused, not run on the base
    model."""

    name = NAME

    def request(self, req: Req) -> None:
        if "lora_name" in req.params.ext:
            raise ValueError(f"lora_name {req.params.ext['lora_name']!r}: LoRA needs --enable-lora")


def make_feature(scheduler: Any) -> StepFeature:
    """The `step_features` factory."""
    from minisgl.ext.lora.layers import LoraModelTransform

    options = lora_options(scheduler.config)
    if not options.enable_lora:
        return LoraOff()
    transform = scheduler.engine.model_transform
    if not isinstance(transform, LoraModelTransform):
        raise RuntimeError("--enable-lora: the engine was built without the LoRA transform")
    return LoraFeature(scheduler, transform, options)


class EngineOptions:
    """The LoRA options of the engine about to be built: the scheduler's options reach the
    engine's `model_transform` through the `engine_config` point, which sees both configs
    right before the scheduler builds its engine (`scheduler.io.build_scheduler`). Taken once,
    so an engine built later in the process (a draft model's) gets no LoRA."""

    pending: LoraOptions | None = None

    @classmethod
    def keep(cls, config: Any, sched: Any) -> Any:
        """The `engine_config` point: `config` unchanged."""
        options = lora_options(sched)
        cls.pending = options if options.enable_lora else None
        return config

    @classmethod
    def take(cls) -> LoraOptions | None:
        options, cls.pending = cls.pending, None
        return options


def wrap_transform(inner: Any) -> Any:
    """The `model_transform` point: the LoRA transform around `inner`'s (the cpu extension's
    quantization, which LoraStack refuses) for an engine built with --enable-lora."""

    def make(engine: Any) -> ModelTransform | None:
        from minisgl.ext.lora.layers import LoraModelTransform

        base = inner(engine) if inner is not None else None
        options = EngineOptions.take()
        if options is None:
            return base
        rows = engine.config.max_running_requests + 1  # the page table's rows, the dummy's too
        return LoraModelTransform(
            options.max_loras, options.max_lora_rank, rows, engine.device, base
        )

    return make


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's `LoRARequest(lora_name, lora_int_id, lora_path)`: run a prompt on the adapter
    served as `lora_name`, read from `lora_path` (a directory or a hub id) if it is not yet.
    `lora_int_id` is vLLM's own handle, kept for compatibility (names identify adapters)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id


def offline_lora(llm: Any, request: Any, params: Sequence[SamplingParams]) -> list[SamplingParams]:
    """The `lora_request` point (`LLM.generate`): each prompt's params naming its adapter
    (None in a list: the base model), an adapter not served yet read now. ValueError for a bad
    request, an adapter that cannot be read, or LoRA off."""
    requests = list(request) if isinstance(request, (list, tuple)) else [request] * len(params)
    if len(requests) != len(params):
        raise ValueError(f"got {len(requests)} lora_request for {len(params)} prompts")
    feature = _feature(llm)
    for r in requests:
        if r is not None and not isinstance(r, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(r).__name__}")
        served = feature.manager.paths.get(r.lora_name) if r is not None else None
        if r is not None and served is not None and r.lora_path not in ("", served):
            message = f"already served from {served!r}, not {r.lora_path!r}"
            raise ValueError(f"lora_request {r.lora_name!r}: {message}")
        if r is not None and served is None:
            if not r.lora_path:
                raise ValueError(f"lora_request {r.lora_name!r}: not served, and no lora_path")
            if getattr(llm, "workers", None):  # the other TP ranks could not read it
                message = "with tp > 1 an adapter must be served from the start (lora_modules)"
                raise ValueError(f"lora_request {r.lora_name!r}: {message}")
            feature.manager.add(r.lora_name, r.lora_path)
    return [
        replace(p, ext={**p.ext, "lora_name": r.lora_name if r else None})
        for p, r in zip(params, requests)
    ]


def _feature(llm: Any) -> LoraFeature:
    if getattr(llm, "replicas", None) is not None:
        raise ValueError("lora_request is not supported with dp > 1")
    feature = next((f for f in llm.scheduler.features if f.name == NAME), None)
    if not isinstance(feature, LoraFeature):
        raise ValueError("lora_request needs LLM(..., enable_lora=True)")
    return feature
