"""Engine: one TP worker's model, KV pool, page and token tables, attention backend and CUDA
graphs; runs a Batch in two phases, `forward` then `sample`, neither waiting for the device."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from minisgl.attention import create_attention_backend
from minisgl.context import Context, set_global_ctx
from minisgl.core import Batch, Req
from minisgl.distributed import all_reduce_min, get_tp_info
from minisgl.engine.config import KV_CACHE_DTYPES, EngineConfig, config_model_path, model_len
from minisgl.engine.graph import GraphRunner
from minisgl.engine.sample import Filters, any_filter, greedy, sample
from minisgl.engine.step import ForwardOutput, StepInputs, run_step
from minisgl.engine.tables import TableWrites
from minisgl.extension import ForwardPath, StepFeature, extensions
from minisgl.kernel import resolve_moe_backend
from minisgl.kvcache.pool import MHAKVCache
from minisgl.models.config import ModelConfig
from minisgl.models.hf import load_hf_config
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weight import init_dummy_weights, iter_checkpoint, load_weights
from minisgl.utils.device import resolve_device

logger = logging.getLogger(__name__)


def _resolve_dtype(config: EngineConfig, hf_config, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":  # float32, the exact path (ext/cpu chooses first: `engine_config`)
        return torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.bfloat16 if dtype in (None, torch.float32) else dtype


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_path = config_model_path(config)
        self.hf_config = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        if (moe := self.model_config.moe) is not None:
            backend = resolve_moe_backend(config.moe_backend, self.device.type)
            self.model_config = replace(self.model_config, moe=replace(moe, backend=backend))
        self.dtype = _resolve_dtype(config, self.hf_config, self.device)
        kv_name = KV_CACHE_DTYPES[config.kv_cache_dtype]
        self.kv_dtype = getattr(torch, kv_name) if kv_name is not None else self.dtype
        make = extensions().model_transform  # e.g. ext/cpu's quantized layers
        self.model_transform = make(self) if make is not None else None
        self.quantization = "none" if self.model_transform is None else self.model_transform.name
        self.max_model_len = model_len(config, self.model_config)
        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.kv_cache = self._build_kv_cache()
        # The pool's last page and the page table's last row are never handed out: padded
        # CUDA-graph entries and unsampled tokens write there instead of into a request's KV.
        self.num_pages = self.kv_cache.num_pages - 1  # (and the dummy page's index)
        self.dummy_row = config.max_running_requests
        self.page_size = config.page_size
        # a request never holds more tokens than the model's context or the whole pool
        self.max_seq_len = min(self.max_model_len, self.num_pages * self.page_size)
        pages_per_req = -(-self.max_seq_len // self.page_size)
        rows = config.max_running_requests + 1
        self.page_table = torch.full(
            (rows, pages_per_req), self.num_pages, dtype=torch.int32, device=self.device
        )
        # token ids by (row, position): a step reads its inputs here, so the tokens sampled by
        # the step still running on the device need no trip through the host (overlap)
        self.token_table = torch.zeros(
            (rows, self.max_seq_len + 1), dtype=torch.int32, device=self.device
        )
        cfg = self.model_config
        self.attn_backend = create_attention_backend(
            config.attn_backends, self.device, cfg.sliding_window, dtype=self.dtype,
            num_qo_heads=cfg.num_heads // get_tp_info().size, kv_dtype=self.kv_dtype,
        )  # fmt: skip
        compile = extensions().decoder_transform  # ext/cpu: CPU speed paths, --enable-torch-compile
        self.compiled_decoder = compile(self) if compile is not None else None
        writes = extensions().table_writes or TableWrites  # ext/perf's: one copy a step
        self.table_writes = writes(self.page_table, self.token_table)
        self.ctx = Context(config.page_size, self.page_table, self.kv_cache, self.attn_backend)
        set_global_ctx(self.ctx)
        self.graphs = self._build_graphs()
        # set by the scheduler: processors and observers of the logits, speed paths (and
        # speculative decoding's verification) for batches the graphs cannot replay as they are
        self.features: list[StepFeature] = []
        self.forward_paths: list[ForwardPath] = []

    def _build_model(self) -> LlamaForCausalLM:
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.model_config)  # every architecture's decoder
        finally:
            torch.set_default_dtype(old_dtype)
        transform = self.model_transform
        skip = transform.before_load(model) if transform is not None else set()
        if self.config.dummy_weights:
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, iter_checkpoint(self.model_path), skip)
        if transform is not None:
            transform.after_load(model)
        return model.eval()

    def _build_kv_cache(self) -> MHAKVCache:
        cfg, page_size, num_pages = self.model_config, self.config.page_size, self.config.num_pages
        kv_heads = max(1, cfg.num_kv_heads // get_tp_info().size)
        per_page = MHAKVCache.bytes_per_page(
            cfg.num_layers, page_size, kv_heads, cfg.head_dim, self.kv_dtype
        )
        if num_pages is None:
            budget = self.config.cpu_kv_cache_mb << 20
            if self.device.type == "cuda":  # 1 GiB kept for activations
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.memory_ratio) - (1 << 30)
            # never more than every running request at full length needs
            wanted = self.config.max_running_requests * -(-self.max_model_len // page_size)
            # every rank schedules alike, so every rank's pool must be as large
            num_pages = all_reduce_min(min(budget // per_page, wanted))
            if num_pages < 1:
                raise ValueError("not enough memory for a single KV cache page")
        mib = num_pages * per_page / 2**20
        logger.info("KV cache: %d pages of %d tokens (%.1f MiB)", num_pages, page_size, mib)
        shape = (cfg.num_layers, num_pages + 1, page_size, kv_heads, cfg.head_dim)
        return MHAKVCache(*shape, self.kv_dtype, self.device)

    def set_pages(self, table_idx: int, start_page: int, pages: list[int]) -> None:
        """Pages [start_page, ...) of row table_idx, sent at the next step's head."""
        if pages:
            self.table_writes.write_pages(table_idx, start_page, pages)
            self.ctx.page_table_version += 1

    def set_tokens(self, table_idx: int, tokens: list[int], start: int = 0) -> None:
        """Token ids of row table_idx from position `start`, sent at the next step's head."""
        self.table_writes.write_tokens(table_idx, start, tokens)

    def decoder(self, batch: Batch) -> torch.nn.Module:
        """Decode steps' compiled decoder (eager for what it cannot hold), else the model's own."""
        if self.compiled_decoder is not None and batch.is_decode:
            return self.compiled_decoder
        return self.model.model

    @torch.inference_mode()
    def forward(self, batch: Batch, samples: list[bool] | None = None) -> ForwardOutput:
        """Phase 1: queue the forward. A decode batch replays its CUDA graph, which samples the
        rows whose `samples` flag is set; another tries the speed paths, else runs eagerly."""
        samples = samples or [False] * batch.size
        self.table_writes.flush()
        reqs = batch.reqs
        features = []  # those acting on some request of the batch (usually none)
        if self.features and any(r.ext for r in reqs):
            features = [f for f in self.features if any(f.name in r.ext for r in reqs)]
        changes = any(f.changes_logits for f in features)
        filtered = any_filter(reqs, self.model_config.vocab_size)
        resample = changes or filtered  # `sample` draws these ids again: the graph skips them
        out = self._run(batch, samples, resample)
        out.features, out.changes, out.filtered = features, changes, filtered
        if resample:
            out.sampled = None
        return out

    def _run(self, batch: Batch, samples: list[bool], resample: bool) -> ForwardOutput:
        if self.graphs is not None and self.graphs.can_run(batch):
            return self.graphs.replay(batch, samples, resample)
        for path in self.forward_paths:  # a verify step, a small prefill as graph rows...
            if (out := path.forward(self, batch, samples, resample)) is not None:
                return out
        return self.eager(batch, samples)

    def eager(self, batch: Batch, samples: list[bool]) -> ForwardOutput:
        """The step run without graphs, keeping every computed token's hidden states."""
        host = StepInputs.pack(batch.reqs, samples, self.dummy_row, self.device)
        inputs = StepInputs.unpack(host.to(self.device, non_blocking=True), batch.size)
        self.attn_backend.prepare(batch)
        return run_step(self, batch, inputs, sample=False)

    @torch.inference_mode()
    def sample(
        self, batch: Batch, out: ForwardOutput, prepared: dict[str, Any] | None = None
    ) -> StepOutput:
        """Phase 2: sample what the forward did not (filters, processed logits, eager batches)
        into the token table, and queue the ids' copy to the host."""
        self.table_writes.flush()  # token writes since the forward land before this step's ids
        rows = batch if out.rows is None else out.rows  # a speed path may have run other rows
        next_ids = self._sample_rows(rows, out, prepared or {})
        if out.regroup is not None:  # their ids -> the batch's (and the path's work with them)
            next_ids = out.regroup(next_ids)
        return StepOutput(next_ids, out.results)

    def _sample_rows(
        self, batch: Batch, out: ForwardOutput, prepared: dict[str, Any]
    ) -> torch.Tensor:
        """Observers read the raw outputs, processors change the logits in stage order, then
        the rows the graph did not sample are drawn into the token table."""
        next_ids, features = out.sampled, out.features
        observed = [(f, f.observe(self, batch, out)) for f in features]
        if next_ids is None:  # (always None when some feature changes logits or filters)
            masked = False
            for f in sorted(features, key=lambda f: f.stage):
                masked |= f.process(self, batch, out, prepared.get(f.name), masked)
            next_ids = self._draw(batch.reqs, out)
            self.token_table[out.inputs.write_rows, out.inputs.kv_lens] = next_ids.to(torch.int32)
        for f, seen in observed:
            if seen is not None:
                seen.finish(next_ids)
                out.results[f.name] = seen
        return next_ids

    def _draw(self, reqs: list[Req], out: ForwardOutput) -> torch.Tensor:
        """Eager sampling from the step's own inputs on the device, with filter arguments built
        on the host only when some request uses top-k, top-p or min-p."""
        if not out.filtered and all(r.params.is_greedy for r in reqs):
            return greedy(out.logits)
        vocab, inputs = self.model_config.vocab_size, out.inputs
        filters = Filters.of(reqs, vocab, self.device) if out.filtered else None
        return sample(out.logits, inputs.temperatures, inputs.seeds, inputs.kv_lens, filters)

    def _build_graphs(self) -> GraphRunner | None:
        max_bs = min(self.config.cuda_graph_max_bs, self.config.max_running_requests)
        if self.device.type != "cuda" or max_bs == 0:
            return None
        moe = self.model_config.moe
        if moe is not None and moe.backend != "triton":
            # the torch expert loop picks experts on the host: nothing a graph can replay
            logger.warning("CUDA graphs are off for MoE models with --moe-backend %s", moe.backend)
            return None
        try:
            self.attn_backend.init_cuda_graph(max_bs)
        except NotImplementedError:
            logger.warning("attention backend %s has no CUDA graphs: graphs off", self.config.attn)
            return None
        return GraphRunner(self, max_bs)

    def shutdown(self) -> None:
        self.graphs = None
        set_global_ctx(None)


class StepOutput:
    """Sampled ids (and the features' `results`) on their way to the host, queued behind the
    step's kernels: reading them waits only for those."""

    def __init__(self, next_ids: torch.Tensor, results: dict[str, Any]) -> None:
        self.host, self.results = next_ids, results
        self.event: torch.cuda.Event | None = None
        if next_ids.is_cuda:
            self.host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
            self.host.copy_(next_ids, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tokens(self) -> list[int]:
        """The sampled ids (waits for the copies, the results' too)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
