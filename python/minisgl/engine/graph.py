"""CUDA graphs for decode: one graph per batch size in a ladder up to `cuda_graph_max_bs`,
captured once at start; a decode batch is padded to the next captured size with dummy
requests that read and write only the engine's dummy page."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from minisgl.core import Batch, Req, SamplingParams

if TYPE_CHECKING:
    from minisgl.engine.engine import Engine


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8))
    return sorted(set(sizes + [max_bs]))


class GraphRunner:
    def __init__(self, engine: Engine, max_bs: int) -> None:
        self.engine = engine
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = max_bs
        device = engine.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int32, device=device)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.out_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
        self.logits_indices = torch.arange(max_bs, device=device)
        self.dummy_slot = engine.dummy_page * engine.page_size
        self.padding = [
            Req([0], 1, SamplingParams(), 2, table_idx=engine.dummy_row, extend_len=1)
            for _ in range(max_bs)
        ]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, Batch]] = {}
        self._capture()

    def _static_batch(self, reqs: list[Req]) -> Batch:
        bs = len(reqs)
        return Batch(
            reqs,
            "decode",
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            out_loc=self.out_loc[:bs],
        )

    @torch.inference_mode()
    def _capture(self) -> None:
        engine, pool = self.engine, None
        self.out_loc.fill_(self.dummy_slot)
        stream = torch.cuda.Stream()
        for bs in tqdm(self.sizes[::-1], desc="Capturing CUDA graphs", leave=False):
            batch = self._static_batch(self.padding[:bs])
            engine.attn_backend.prepare_for_capture(batch)
            engine.ctx.batch = batch
            try:
                # a warm-up run outside capture lets lazy initialisation (autotuning, JIT) happen
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    engine.model(batch.input_ids, batch.positions, self.logits_indices[:bs])
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = engine.model(
                        batch.input_ids, batch.positions, self.logits_indices[:bs]
                    )
            finally:
                engine.ctx.batch = None
            pool = graph.pool()
            self.graphs[bs] = (graph, logits, batch)
        torch.cuda.synchronize()

    def can_run(self, batch: Batch) -> bool:
        return batch.is_decode and batch.size <= self.max_bs

    def replay(self, batch: Batch) -> torch.Tensor:
        """Run a prepared decode batch (input ids, positions, out_loc set) -> logits [B, V]."""
        bs = batch.size
        padded = next(size for size in self.sizes if size >= bs)
        graph, logits, static = self.graphs[padded]
        self.input_ids[:bs].copy_(batch.input_ids)
        self.positions[:bs].copy_(batch.positions)
        self.out_loc[:bs].copy_(batch.out_loc)
        if padded > bs:  # stale slots of a larger earlier batch must not be written again
            self.out_loc[bs:padded].fill_(self.dummy_slot)
        static.reqs = batch.reqs + self.padding[: padded - bs]
        self.engine.attn_backend.prepare_for_replay(static)
        graph.replay()
        return logits[:bs]
