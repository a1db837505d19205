"""One forward step, written once: its per-request inputs (`StepInputs`, one small host block)
and `run_step`, which the eager path calls and the CUDA graphs capture."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Protocol

import torch

from minisgl import kernel
from minisgl.core import Batch, Req
from minisgl.engine.sample import MASK32
from minisgl.engine.sample import sample as sample_ids  # `sample`: run_step's flag

if TYPE_CHECKING:
    from minisgl.attention.base import BaseAttnBackend
    from minisgl.context import Context
    from minisgl.extension import StepFeature
    from minisgl.models.llama import LlamaForCausalLM


class StepEngine(Protocol):
    """What a step reads of its `Engine` (which imports this module and the graphs)."""

    ctx: Context
    model: LlamaForCausalLM
    attn_backend: BaseAttnBackend
    token_table: torch.Tensor
    dummy_row: int
    device: torch.device

    def decoder(self, batch: Batch) -> torch.nn.Module: ...


@dataclass
class StepInputs:
    """A step's per-request inputs on the device: views of the rows of one int64 block (`pack`),
    a row per field in this order, so that a graph's step starts with no conversion kernel."""

    rows: torch.Tensor  # page-table (and token-table) row
    cached_lens: torch.Tensor  # tokens whose KV is in the pool
    extend_lens: torch.Tensor  # tokens this step computes
    kv_lens: torch.Tensor  # cached + extend: the sampled id's position
    write_rows: torch.Tensor  # row the sampled id goes to: own row, or the dummy row if unsampled
    seeds: torch.Tensor  # low 32 bits of the sampling seed (all the sampling hash reads)
    skips: torch.Tensor  # 1: a CUDA graph's sampling passes the row (unsampled, or resampled)
    # float32, 0 = greedy: the low half of each int64 (a strided view, no conversion kernel)
    temperatures: torch.Tensor

    @staticmethod
    def pack(
        reqs: list[Req],
        samples: list[bool],
        dummy_row: int,
        device: torch.device,
        resample: bool = False,
    ) -> torch.Tensor:
        """The host block [8, len(reqs) rounded up to even] (`resample`: every row is sampled
        again after the forward). An even width aligns every row to 16 bytes: Triton compiles a
        variant per alignment, which would stall a run mid-way."""
        pad = [0] * (len(reqs) % 2)
        host = torch.tensor(
            [
                [r.table_idx for r in reqs] + pad,
                [r.cached_len for r in reqs] + pad,
                [r.extend_len for r in reqs] + pad,
                [r.cached_len + r.extend_len for r in reqs] + pad,
                [r.table_idx if s else dummy_row for r, s in zip(reqs, samples)] + pad,
                [r.seed & MASK32 for r in reqs] + pad,
                [int(resample or not s) for s in samples] + pad,
                [0] * (len(reqs) + len(pad)),
            ],
            dtype=torch.int64,
            pin_memory=device.type == "cuda",
        )
        temps = [r.params.sampling_temperature for r in reqs]
        _low_halves(host[-1])[: len(reqs)].copy_(torch.tensor(temps, dtype=torch.float32))
        return host

    def pick(self, index: slice | torch.Tensor) -> StepInputs:
        return StepInputs(*(getattr(self, f.name)[index] for f in fields(self)))

    @staticmethod
    def unpack(block: torch.Tensor, size: int) -> StepInputs:
        """Views of the first `size` columns of a `pack`ed block (on the device)."""
        rows, cached, extend, kv_lens, write_rows, seeds, skips, bits = block[:, :size]
        temperatures = _low_halves(bits)
        return StepInputs(rows, cached, extend, kv_lens, write_rows, seeds, skips, temperatures)


def _low_halves(row: torch.Tensor) -> torch.Tensor:
    """The float32 view of each int64's low 32 bits (little-endian: the first half)."""
    return row.view(torch.float32)[0::2]


@dataclass
class ForwardOutput:
    """A queued forward, a row per request: its last token's logits, where its sampled id goes
    (token_table[write_rows, kv_lens]), the id if the step sampled it."""

    logits: torch.Tensor  # [B, V]
    inputs: StepInputs  # [B] each: rows, kv_lens (the sampled id's position), seeds...
    sampled: torch.Tensor | None  # [B] or None
    hidden: torch.Tensor | None = None  # [num_tokens, hidden]: every computed token's
    rows: Batch | None = None  # the rows computed, when not the batch's own
    # the sampled ids -> the batch's (of `rows`; and what the path computes from them)
    regroup: Callable[[torch.Tensor], torch.Tensor] | None = None
    features: list[StepFeature] = field(default_factory=list)  # acting on some request
    changes: bool = False  # some feature changes some request's logits (resampled eagerly)
    filtered: bool = False  # some request samples with top-k, top-p or min-p
    results: dict[str, Any] = field(default_factory=dict)  # what the features observed

    def pick(self, index: slice | torch.Tensor) -> ForwardOutput:
        """The rows at `index` (a slice or a device tensor), without the hidden states."""
        sampled = None if self.sampled is None else self.sampled[index]
        return ForwardOutput(self.logits[index], self.inputs.pick(index), sampled)


def fill_token_inputs(engine: StepEngine, batch: Batch, inputs: StepInputs) -> torch.Tensor | None:
    """Set the batch's per-token input_ids (from the token table), positions and out_loc;
    return each request's last token's flat index (None in a decode step: every token)."""
    extend = inputs.extend_lens
    if batch.is_decode:
        rows, positions, last = inputs.rows, inputs.cached_lens, None
    else:
        ends = extend.cumsum(0)  # one past each request's last token in the flat batch
        last = ends - 1
        n = batch.num_tokens  # given, so that expanding needs no host sync
        rows = inputs.rows.repeat_interleave(extend, output_size=n)
        # per token: its flat index minus its position, constant within a request
        shift = (ends - extend - inputs.cached_lens).repeat_interleave(extend, output_size=n)
        positions = torch.arange(n, device=extend.device) - shift
    ctx = engine.ctx
    if batch.is_decode and (ops := kernel.fused_ops(rows)) is not None:
        batch.input_ids, batch.out_loc = ops.decode_inputs(
            engine.token_table, ctx.page_table, rows, positions, ctx.page_size
        )
    else:  # the reference
        batch.input_ids = engine.token_table[rows, positions]
        batch.out_loc = ctx.kv_slots(rows, positions)
    batch.positions, batch.rows = positions, rows
    return last


def run_step(engine: StepEngine, batch: Batch, inputs: StepInputs, sample: bool) -> ForwardOutput:
    """Gather the inputs, run the model and, if `sample`, draw each request's next id into the
    token table. No host sync, no shape from device values: CUDA graphs capture it as it is."""
    logits_indices = fill_token_inputs(engine, batch, inputs)
    engine.ctx.batch = batch
    try:
        hidden = engine.decoder(batch)(batch.input_ids, batch.positions)  # normed, every token
        last = hidden if logits_indices is None else hidden[logits_indices]
        logits = engine.model.compute_logits(last)
    finally:
        engine.ctx.batch = None
    sampled = None
    if sample:
        args = (logits, inputs.temperatures, inputs.seeds, inputs.kv_lens)
        into = (engine.token_table, inputs.write_rows)
        sampled = sample_ids(*args, skip=inputs.skips, into=into)
    return ForwardOutput(logits, inputs, sampled, hidden)
