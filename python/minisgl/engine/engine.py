"""Engine: one TP worker's model, KV pool, page table and attention backend; runs a Batch."""

from __future__ import annotations

import logging
import os

import torch

from minisgl.attention import create_attention_backend
from minisgl.core import Batch, Context, set_global_ctx
from minisgl.distributed import get_tp_info
from minisgl.engine.config import EngineConfig
from minisgl.engine.sample import BatchSamplingArgs, sample
from minisgl.kvcache import MHAKVCache
from minisgl.models import (
    ModelConfig,
    get_model_class,
    init_dummy_weights,
    load_weights,
    resolve_model_path,
)
from minisgl.models.weight import iter_checkpoint

logger = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def load_hf_config(model_path: str):  # -> transformers.PretrainedConfig
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(model_path, "config.json")):
        raise ValueError(f"missing config.json in model directory {model_path!r}")
    return AutoConfig.from_pretrained(model_path)


def _resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
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
        self.model_path = resolve_model_path(config.model_path)
        self.hf_config = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        self.dtype = _resolve_dtype(config.dtype, self.hf_config, self.device)
        cfg = self.model_config
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )

        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.kv_cache = self._build_kv_cache()
        self.num_pages = self.kv_cache.num_pages
        self.page_size = config.page_size
        # a request never holds more tokens than the model's context or the whole pool
        self.max_seq_len = min(self.max_model_len, self.num_pages * self.page_size)
        pages_per_req = -(-self.max_seq_len // self.page_size)
        self.page_table = torch.zeros(
            config.max_running_reqs, pages_per_req, dtype=torch.int32, device=self.device
        )
        self.attn_backend = create_attention_backend(config.attn, self.device, cfg.sliding_window)
        self.ctx = Context(config.page_size, self.page_table, self.kv_cache, self.attn_backend)
        set_global_ctx(self.ctx)

    def _build_model(self) -> torch.nn.Module:
        cls = get_model_class(self.model_config.architecture)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.config.dummy_weights:
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, iter_checkpoint(self.model_path))
        return model.eval()

    def _build_kv_cache(self) -> MHAKVCache:
        cfg, tp = self.model_config, get_tp_info()
        kv_heads = max(1, cfg.num_kv_heads // tp.size)
        page_size = self.config.page_size
        per_page = MHAKVCache.bytes_per_page(
            cfg.num_layers, page_size, kv_heads, cfg.head_dim, self.dtype
        )
        num_pages = self.config.num_pages
        if num_pages is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * self.config.memory_ratio) - (
                    1 << 30
                )  # keep 1 GiB for activations
            else:
                budget = self.config.cpu_kv_cache_mb << 20
            # never more than every running request at full length needs
            wanted = self.config.max_running_reqs * -(-self.max_model_len // page_size)
            num_pages = min(budget // per_page, wanted)
            if num_pages < 1:
                raise ValueError("not enough memory for a single KV cache page")
        logger.info(
            "KV cache: %d pages of %d tokens (%.1f MiB)",
            num_pages,
            page_size,
            num_pages * per_page / 2**20,
        )
        return MHAKVCache(
            cfg.num_layers, num_pages, page_size, kv_heads, cfg.head_dim, self.dtype, self.device
        )

    def set_pages(self, table_idx: int, start_page: int, pages: list[int]) -> None:
        """Record pages [start_page, start_page + len(pages)) of the request in row table_idx."""
        if pages:
            src = torch.tensor(pages, dtype=torch.int32)
            self.page_table[table_idx, start_page : start_page + len(pages)].copy_(
                src, non_blocking=True
            )

    def prepare(self, batch: Batch) -> None:
        """Fill the batch's input ids, positions and KV write slots, then attention metadata."""
        ids, positions, rows = [], [], []
        for r in batch.reqs:
            ids.extend(r.tokens[r.cached_len : r.cached_len + r.extend_len])
            positions.extend(range(r.cached_len, r.cached_len + r.extend_len))
            rows.extend([r.table_idx] * r.extend_len)
        host = torch.tensor([ids, positions, rows], dtype=torch.int64)
        ids_t, pos_t, rows_t = host.to(self.device, non_blocking=True)
        page = self.page_table[rows_t, pos_t // self.page_size].long()
        batch.input_ids, batch.positions = ids_t, pos_t
        batch.out_loc = page * self.page_size + pos_t % self.page_size
        self.attn_backend.prepare(batch)

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Run the model; logits [B, vocab] (float32) of each request's last computed token."""
        self.prepare(batch)
        last = torch.tensor([r.extend_len for r in batch.reqs]).cumsum(0) - 1
        self.ctx.batch = batch
        try:
            logits = self.model(batch.input_ids, batch.positions, last.to(self.device))
        finally:
            self.ctx.batch = None
        return logits.float()

    @torch.inference_mode()
    def forward_and_sample(self, batch: Batch) -> torch.Tensor:
        """Next token id of every request in the batch, on the host."""
        logits = self.forward(batch)
        args = BatchSamplingArgs.from_reqs(batch.reqs, self.model_config.vocab_size, self.device)
        return sample(logits, args).cpu()

    def shutdown(self) -> None:
        set_global_ctx(None)
