"""CUDA graphs for decode: one graph per batch size in a ladder up to `cuda_graph_max_bs`,
captured once at start; a decode batch is padded to the next captured size with dummy
requests that read and write only the engine's dummy row and page.

A graph holds the whole step, not only the model: it gathers the input ids and KV slots from
the token and page tables, runs the model, samples (temperature / greedy; top-k, top-p, min-p
and grammar masks resample eagerly from its logits) and writes the sampled ids back into the
token table. The host's part of a step is then one small copy, the attention backend's
metadata and the replay: with a small batch, host time per step is what bounds decode."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
from tqdm import tqdm

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.sample import sample_at_temperature

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine

# rows of GraphRunner.inputs
_ROW, _POSITION, _WRITE_ROW, _SEED, _TEMPERATURE = range(5)
_MASK32 = 0xFFFFFFFF


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


class GraphOutput(NamedTuple):
    """Static tensors a replay fills, one row per request: the logits, the ids sampled, and
    where those went in the token table."""

    logits: torch.Tensor  # [bs, V]
    sampled: torch.Tensor  # [bs]
    write_rows: torch.Tensor  # [bs]
    kv_lens: torch.Tensor  # [bs] positions of the sampled ids


class GraphRunner:
    def __init__(self, engine: Engine, max_bs: int, capture: bool = True) -> None:
        """capture=False runs the same steps eagerly, without graphs (tests on CPU)."""
        self.engine = engine
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        # The step's per-request inputs in one float64 block, so one copy carries them: every
        # value but the temperature is an integer below 2**53 (seeds: their low 32 bits, all
        # the sampling hash reads). Padding rows point at the dummy row and page.
        self.inputs = torch.zeros(5, max_bs, dtype=torch.float64, device=engine.device)
        self.inputs[_ROW] = self.inputs[_WRITE_ROW] = engine.dummy_row
        self.logits_indices = torch.arange(max_bs, device=engine.device)
        self.padding = [
            Req([0], 1, SamplingParams(), 2, table_idx=engine.dummy_row, extend_len=1)
            for _ in range(max_bs)
        ]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, GraphOutput | None, Batch]] = {
            bs: (None, None, Batch(self.padding[:bs], "decode")) for bs in self.sizes
        }
        if capture:
            self._capture()

    def _step(self, batch: Batch) -> GraphOutput:
        """The captured work of a decode step over the first batch.size rows of `inputs`."""
        engine, bs = self.engine, batch.size
        inputs = self.inputs[:, :bs]
        rows, positions = inputs[_ROW].long(), inputs[_POSITION].long()
        write_rows, kv_lens = inputs[_WRITE_ROW].long(), positions + 1
        batch.positions = positions
        batch.input_ids = engine.token_table[rows, positions]
        batch.out_loc = engine.ctx.kv_slots(rows, positions)
        engine.ctx.batch = batch
        try:
            logits = engine.model(batch.input_ids, positions, self.logits_indices[:bs])
        finally:
            engine.ctx.batch = None
        temperature, seeds = inputs[_TEMPERATURE].float(), inputs[_SEED].long()
        sampled = sample_at_temperature(logits, temperature, seeds, kv_lens)
        engine.token_table[write_rows, kv_lens] = sampled.to(torch.int32)
        return GraphOutput(logits, sampled, write_rows, kv_lens)

    @torch.inference_mode()
    def _capture(self) -> None:
        engine, pool = self.engine, None
        stream = torch.cuda.Stream()
        for bs in tqdm(self.sizes[::-1], desc="Capturing CUDA graphs", leave=False):
            batch = Batch(self.padding[:bs], "decode")
            engine.attn_backend.prepare_for_capture(batch)
            # a warm-up run outside capture lets lazy initialisation (autotuning, JIT) happen
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._step(batch)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._step(batch)
            pool = graph.pool()
            self.graphs[bs] = (graph, out, batch)
        torch.cuda.synchronize()

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def replay(self, batch: Batch, samples: list[bool]) -> GraphOutput:
        """Run a decode batch; the ids sampled for the requests whose `samples` flag is set
        land in the token table after their last token (the others' in the dummy row)."""
        bs, engine = batch.size, self.engine
        padded = next(size for size in self.sizes if size >= bs)
        graph, out, static = self.graphs[padded]
        pad = padded - bs
        dummy = engine.dummy_row
        reqs = batch.reqs
        rows = [r.table_idx for r in reqs] + [dummy] * pad
        host = torch.tensor(
            [
                rows,
                [r.cached_len for r in reqs] + [0] * pad,
                [r if s else dummy for r, s in zip(rows, samples)] + [dummy] * pad,
                [r.seed & _MASK32 for r in reqs] + [0] * pad,
                [0.0 if r.params.is_greedy else r.params.temperature for r in reqs] + [0.0] * pad,
            ],
            dtype=torch.float64,
            # pinned: a copy from pageable memory would wait for the queued steps
            pin_memory=engine.device.type == "cuda",
        )
        self.inputs[:, :padded].copy_(host, non_blocking=True)
        static.reqs = reqs + self.padding[:pad]
        if graph is None:
            engine.attn_backend.prepare(static)
            out = self._step(static)
        else:
            engine.attn_backend.prepare_for_replay(static)
            graph.replay()
        assert out is not None
        return GraphOutput(*(t[:bs] for t in out))
