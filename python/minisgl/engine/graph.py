"""CUDA graphs for decode: one per batch size in a ladder up to `cuda_graph_max_bs`, captured
at start; a batch is padded to the next size with requests of the dummy row and page. A graph
holds the whole step (`run_step`: inputs gathered from the tables, model, sampling, ids into
the token table), so the host's part is one small copy, the attention metadata and the replay:
with a small batch, host time per step is what bounds decode."""

from __future__ import annotations

import torch
from tqdm import tqdm

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.step import ForwardOutput, StepEngine, StepInputs, run_step


class GraphRunner:
    def __init__(self, engine: StepEngine, max_bs: int, capture: bool = True) -> None:
        """capture=False runs the same steps eagerly, without graphs (tests on CPU)."""
        self.engine = engine
        sizes = [bs for bs in (1, 2, 4) if bs < max_bs] + list(range(8, max_bs, 8))
        self.sizes = sorted(set(sizes + [max_bs]))
        self.max_bs = max_bs
        self.padding = [
            Req([0], 1, SamplingParams(seed=0), 2, table_idx=engine.dummy_row, extend_len=1)
            for _ in range(max_bs)
        ]
        # each graph's static StepInputs block (padding at capture), refilled before each
        # replay; one per size: a copy into a slice of a shared one would add a kernel
        self.blocks = {
            bs: StepInputs.pack(
                self.padding[:bs], [False] * bs, engine.dummy_row, engine.device
            ).to(engine.device)
            for bs in self.sizes
        }
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, ForwardOutput | None, Batch]] = {
            bs: (None, None, Batch(self.padding[:bs], "decode")) for bs in self.sizes
        }
        if capture:
            self._capture()

    def _step(self, batch: Batch) -> ForwardOutput:
        """The captured work: the step over its batch size's static block."""
        inputs = StepInputs.unpack(self.blocks[batch.size], batch.size)
        return run_step(self.engine, batch, inputs, sample=True)

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

    def replay(self, batch: Batch, samples: list[bool], resample: bool = False) -> ForwardOutput:
        """Run a decode batch, its sampled ids into the token table (unsampled ones: the dummy
        row). `resample`: the caller samples every row again, so the graph skips them."""
        bs, engine = batch.size, self.engine
        padded = next(size for size in self.sizes if size >= bs)
        graph, out, static = self.graphs[padded]
        pad = padded - bs
        static.reqs, samples = batch.reqs + self.padding[:pad], samples + [False] * pad
        host = StepInputs.pack(static.reqs, samples, engine.dummy_row, engine.device, resample)
        self.blocks[padded].copy_(host, non_blocking=True)
        if graph is None:
            engine.attn_backend.prepare(static)
            out = self._step(static)
        else:
            engine.attn_backend.prepare_for_replay(static)
            graph.replay()
        assert out is not None
        return out.pick(slice(0, bs))
