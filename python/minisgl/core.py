"""Core state: what a user asks for (SamplingParams), one request (Req), one forward (Batch)."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from minisgl.extension import extensions, require

if TYPE_CHECKING:  # torch only for annotations: the tokenizer, detokenizer and API processes
    # import this module and never load torch (issue 47: ~1.4 s and ~200 MB each)
    import torch

    from minisgl.kvcache.prefix_cache import CacheHandle


PLACEHOLDER = -1  # a sampled token id the host has not read yet (its step is in flight)
# SamplingParams' fields that constrain the output (structured generation), one at most
CONSTRAINT_KINDS = ("json_schema", "regex", "ebnf", "structural_tag")
# The extensions' parameters that the core knows by name (SamplingParams.ext): name ->
# (extension, the value that asks for nothing). Without its extension, one set otherwise is
# refused naming it; an extension may declare others (`Extensions.sampling_params`)
EXTENSION_PARAMS: dict[str, tuple[str, Any]] = {
    **{name: ("structured", None) for name in CONSTRAINT_KINDS},
    **{name: ("sampling", 0.0) for name in ("frequency_penalty", "presence_penalty")},
    "repetition_penalty": ("sampling", 1.0),
    "logit_bias": ("sampling", {}),
    "min_tokens": ("sampling", 0),
    **dict.fromkeys(("logprobs", "prompt_logprobs"), ("sampling", None)),
    "lora_name": ("lora", None),
    "priority": ("serving", 0),
}


def check_token_ids(vocab: int, **fields: Iterable[int]) -> None:
    """Every token id a request names is in the vocabulary (no bad id reaches the device)."""
    for name, ids in fields.items():
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= vocab):  # min/max in C: a prompt may be long
            bad = next(t for t in ids if not 0 <= t < vocab)
            raise ValueError(f"{name}: token id {bad} is not in the vocabulary [0, {vocab})")


@dataclass
class _BaseParams:
    """The base sampling settings (temperature 0: greedy) and the extensions' (`ext`)."""

    temperature: float = 0.0
    top_k: int = -1  # -1 or 0: no top-k filter
    top_p: float = 1.0
    min_p: float = 0.0
    max_tokens: int = 128
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    # stop strings (a string is one): the text ends before the first to appear (detokenizer)
    stop: list[str] | str = field(default_factory=list)
    n: int = 1  # offline samples per prompt, sample j seeded seed + j (the server sends n requests)
    # the extensions' parameters that ask for something (logprobs, penalties, a grammar...),
    # each checked by the extension that declares it; read with `get`
    ext: dict[str, Any] = field(default_factory=dict)


class SamplingParams(_BaseParams):
    """Per-request sampling settings. An extension's parameter is a keyword too
    (`SamplingParams(logprobs=5)`), kept in `ext` unless it asks for nothing."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fields = dict(zip(_FIELDS, args), **kwargs)  # positional: as a message is decoded
        ext = dict(fields.pop("ext", None) or {})
        for name in [name for name in fields if name not in _FIELDS]:
            ext[name] = fields.pop(name)
        for name, (_, off) in EXTENSION_PARAMS.items():  # asking for nothing: not kept
            if name in ext and ext[name] == off and type(ext[name]) is not bool:
                del ext[name]  # (a boolean asks: its extension refuses it)
        super().__init__(**fields, ext=ext)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.validate()

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 0, got {self.top_k}")
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative ints, got {self.stop_token_ids}")
        if any(not isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        checks = extensions().sampling_params  # each extension's check once, if one is set
        for name in self.ext:
            if name not in checks and name not in EXTENSION_PARAMS:
                raise TypeError(f"SamplingParams got an unexpected keyword argument {name!r}")
            require(checks.get(name), name, EXTENSION_PARAMS.get(name, ("",))[0])
        for check in dict.fromkeys(checks[name] for name in self.ext):
            check(self)

    def get(self, name: str) -> Any:
        """An extension's parameter (EXTENSION_PARAMS): its value, or the one asking nothing."""
        return self.ext.get(name, EXTENSION_PARAMS[name][1])

    def for_sample(self, j: int) -> SamplingParams:
        """Sample j of n: one request, seeded seed + j (kept within int64)."""
        seed = None if self.seed is None else (self.seed + j) % 2**63
        return dataclasses.replace(self, seed=seed, n=1)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def sampling_temperature(self) -> float:  # the temperature rule, written once
        return 0.0 if self.is_greedy else self.temperature


_FIELDS = [f.name for f in dataclasses.fields(_BaseParams)]


FinishReason = Literal["stop", "length", "abort", "error"]
_uid_counter = itertools.count()


@dataclass(eq=False)
class Req:
    """One request's state. KV exists in the pool for tokens[:cached_len]; the forward that
    schedules it computes tokens[cached_len : cached_len + extend_len]."""

    tokens: list[int]  # prompt followed by the tokens generated so far
    prompt_len: int
    params: SamplingParams
    max_total_len: int  # stop with "length" when len(tokens) reaches this
    uid: int = field(default_factory=lambda: next(_uid_counter))
    seed: int = 0  # sampling seed; drawn at random when the user gave none
    cached_len: int = 0
    extend_len: int = 0  # tokens computed by the forward being built
    table_idx: int = -1  # row in the page table while admitted
    pages: list[int] = field(default_factory=list)
    cache_handle: CacheHandle | None = None  # locked prefix-cache match while admitted
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    error: str | None = None  # why it ended when finish_reason is "error"
    # the extensions' state of this request (a grammar, logprobs...), by StepFeature name
    ext: dict[str, Any] = field(default_factory=dict)
    queued_at: float = field(default_factory=time.monotonic)  # made, and queued right after
    queue_time: float | None = None  # seconds from queued to its first admission (forward)
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied to its first forward

    def __post_init__(self) -> None:
        self.seed = self.params.seed if self.params.seed is not None else random.getrandbits(31)

    @property
    def output_ids(self) -> list[int]:
        return self.tokens[self.prompt_len :]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining_len(self) -> int:
        """Tokens whose KV is not computed yet."""
        return len(self.tokens) - self.cached_len

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


M = TypeVar("M", bound="AttnMetadata")


class AttnMetadata:
    """A backend's per-batch metadata, set by its `prepare`."""

    @classmethod
    def of(cls: type[M], batch: Batch) -> M:
        md = batch.attn_metadata
        assert isinstance(md, cls), f"{cls.__name__} expected, the batch holds {type(md).__name__}"
        return md


@dataclass
class Batch:
    """One forward: the requests, each computing extend_len tokens; the model sees the tensors."""

    reqs: list[Req]
    phase: Literal["prefill", "decode"]
    num_decodes: int = 0  # a prefill's leading decode rows (mixed steps)
    input_ids: torch.Tensor | None = None  # [num_tokens]
    positions: torch.Tensor | None = None  # [num_tokens]
    out_loc: torch.Tensor | None = None  # [num_tokens] KV slot each new token is written to
    rows: torch.Tensor | None = None  # [num_tokens] page-table row of each token (the step's)
    attn_metadata: AttnMetadata | None = None  # the attention backend's, set by its prepare()

    @property
    def size(self) -> int:
        return len(self.reqs)

    @property
    def num_tokens(self) -> int:
        return sum(r.extend_len for r in self.reqs)

    @property
    def is_decode(self) -> bool:
        return self.phase == "decode"


def to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Copy small host data to the device without blocking the host."""
    import torch  # here, not at the top: see the imports

    # pinned: a copy from pageable memory would wait for all queued device work (overlap)
    host = torch.tensor(data, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)
