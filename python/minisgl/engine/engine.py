"""Engine: one TP worker's model, KV pool, page table and attention backend; runs a Batch."""

from __future__ import annotations

import logging
import os
from collections.abc import Collection
from dataclasses import replace

import torch

from minisgl.attention import create_attention_backend
from minisgl.core import Batch, Context, Req, set_global_ctx, to_device
from minisgl.distributed import all_reduce_min, check_tp_size, get_tp_info
from minisgl.engine.config import KV_CACHE_DTYPES, EngineConfig
from minisgl.engine.graph import GraphRunner
from minisgl.engine.logprobs import Entry, PromptLogprobs, SampledLogprobs
from minisgl.engine.sample import (
    AdjustTable,
    BatchSamplingArgs,
    TokenMask,
    adjust_logits,
    any_adjusted,
    any_filter,
    apply_token_bitmask,
    grammar_over_min_tokens,
    greedy,
    sample,
    sample_at_temperature,
)
from minisgl.engine.step import ForwardOutput, StepInputs, run_step
from minisgl.engine.tables import TableWrites
from minisgl.engine.verify import Verification, flat_batch, prefill_rows
from minisgl.extension import extensions, require
from minisgl.kernel import resolve_moe_backend
from minisgl.kvcache import MHAKVCache
from minisgl.models import (
    ModelConfig,
    get_model_class,
    init_dummy_weights,
    load_weights,
    resolve_model_path,
)
from minisgl.models.hf import load_hf_config
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weight import iter_checkpoint
from minisgl.utils.device import device_type, resolve_device
from minisgl.utils.options import OptionError

logger = logging.getLogger(__name__)


def _resolve_dtype(config: EngineConfig, hf_config, device: torch.device, path: str) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":  # float32, the exact path, unless the cpu extension chooses
        choose = extensions().cpu_dtype
        return choose(config.quantization, path) if choose is not None else torch.float32
    dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.bfloat16 if dtype in (None, torch.float32) else dtype


def set_cpu_threads() -> None:
    """Use every core this process may run on (its affinity mask, which containers and
    `taskset` narrow), unless OMP_NUM_THREADS chose already (e.g. a --dp replica's share)."""
    if "OMP_NUM_THREADS" not in os.environ and hasattr(os, "sched_getaffinity"):
        torch.set_num_threads(len(os.sched_getaffinity(0)))


def _model_path(config: EngineConfig) -> str:
    if config.model is None:  # LLM() and the CLI put the embedded model's path there first
        raise ValueError("EngineConfig.model is unset: give a directory, .gguf file or hub id")
    return resolve_model_path(config.model)


def check_model(config: EngineConfig, size: int = 1, gpus: int | None = None) -> None:
    """Fail before any rank starts when the model or the machine cannot take TP `size`
    (`gpus`: those this machine needs, when not `size`: --dp, --nnodes), or --max-model-len
    is above the model's context."""
    cfg = ModelConfig.from_hf(load_hf_config(_model_path(config)))
    check_tp_size(size, cfg.num_heads, cfg.num_kv_heads, device_type(config.device), gpus)
    model_len(config, cfg)


def model_len(config: EngineConfig, cfg: ModelConfig) -> int:
    """--max-model-len, or the model's context when unset. Above the context it is refused, not
    cut: the rotary table ends there, and positions past it were never trained."""
    context = cfg.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > context:
        message = f"{config.max_model_len} is above the model's context of {context} tokens"
        raise OptionError("max_model_len", f"{message} (max_position_embeddings)")
    return config.max_model_len or context


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model_path = _model_path(config)
        self.hf_config = load_hf_config(self.model_path)
        self.model_config = ModelConfig.from_hf(self.hf_config)
        if (moe := self.model_config.moe) is not None:
            backend = resolve_moe_backend(config.moe_backend, self.device.type)
            self.model_config = replace(self.model_config, moe=replace(moe, backend=backend))
        self.dtype = _resolve_dtype(config, self.hf_config, self.device, self.model_path)
        self.kv_dtype = KV_CACHE_DTYPES[config.kv_cache_dtype] or self.dtype
        # what changes the model around its weights' loading (the cpu extension: --quantization)
        make = extensions().model_transform
        self.model_transform = make(self) if make is not None else None
        self.quantization = "none" if self.model_transform is None else self.model_transform.name
        cfg = self.model_config
        check_tp_size(get_tp_info().size, cfg.num_heads, cfg.num_kv_heads, self.device.type)
        self.max_model_len = model_len(config, cfg)

        torch.manual_seed(config.seed)
        self.model = self._build_model()
        self.kv_cache = self._build_kv_cache()
        # The pool's last page and the page table's last row are never handed out: padded
        # CUDA-graph entries and unsampled tokens write there instead of into a request's KV.
        self.num_pages = self.kv_cache.num_pages - 1
        self.dummy_page = self.num_pages
        self.dummy_row = config.max_running_requests
        self.page_size = config.page_size
        # a request never holds more tokens than the model's context or the whole pool
        self.max_seq_len = min(self.max_model_len, self.num_pages * self.page_size)
        pages_per_req = -(-self.max_seq_len // self.page_size)
        rows = config.max_running_requests + 1
        self.page_table = torch.full(
            (rows, pages_per_req), self.dummy_page, dtype=torch.int32, device=self.device
        )
        # token ids by (row, position): a step reads its inputs here, so the tokens sampled by
        # the step still running on the device need no trip through the host (overlap)
        self.token_table = torch.zeros(
            (rows, self.max_seq_len + 1), dtype=torch.int32, device=self.device
        )
        self.attn_backend = create_attention_backend(
            config.attn_backends,
            self.device,
            cfg.sliding_window,
            dtype=self.dtype,
            num_qo_heads=cfg.num_heads // get_tp_info().size,
            kv_dtype=self.kv_dtype,
        )
        self.compiled_decoder = self._compiled_decoder()
        self.table_writes = TableWrites(self.page_table, self.token_table)
        self.ctx = Context(config.page_size, self.page_table, self.kv_cache, self.attn_backend)
        set_global_ctx(self.ctx)
        self.graphs = self._build_graphs()
        self.prefill_as_rows = not config.disable_prefill_graphs
        self.adjustments = AdjustTable(rows, self.device)

    def _build_model(self) -> LlamaForCausalLM:
        cls = get_model_class(self.model_config.architecture)
        old_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = cls(self.model_config)
        finally:
            torch.set_default_dtype(old_dtype)
        if self.device.type == "cpu" and get_tp_info().size == 1:
            set_cpu_threads()
        transform = self.model_transform
        skip = transform.before_load(model) if transform is not None else set()
        if self.config.dummy_weights:
            init_dummy_weights(model, self.config.seed)
        else:
            load_weights(model, iter_checkpoint(self.model_path), skip)
        if transform is not None:
            transform.after_load(model)
        return model.eval()

    def _compiled_decoder(self) -> torch.nn.Module | None:
        """The decoder of one-request decode steps under --enable-torch-compile: the cpu
        extension's `decoder_transform` (EngineConfig refuses the flag without it); else None."""
        if not self.config.enable_torch_compile:
            return None
        return require(extensions().decoder_transform, "--enable-torch-compile", "cpu")(self)

    def _build_kv_cache(self) -> MHAKVCache:
        cfg, tp = self.model_config, get_tp_info()
        kv_heads = max(1, cfg.num_kv_heads // tp.size)
        page_size = self.config.page_size
        per_page = MHAKVCache.bytes_per_page(
            cfg.num_layers, page_size, kv_heads, cfg.head_dim, self.kv_dtype
        )
        num_pages = self.config.num_pages
        if num_pages is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                # keep 1 GiB for activations
                budget = int(free * self.config.memory_ratio) - (1 << 30)
            else:
                budget = self.config.cpu_kv_cache_mb << 20
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
        """Record pages [start_page, start_page + len(pages)) of the request in row table_idx
        (on the device at the next step's head, `TableWrites`)."""
        if pages:
            self.table_writes.write_pages(table_idx, start_page, pages)
            self.ctx.page_table_version += 1

    def set_tokens(self, table_idx: int, tokens: list[int], start: int = 0) -> None:
        """Token ids into a request's row of the token table from position `start`: a newly
        admitted request's known tokens, or the proposals a step verifies (on the device at
        the next step's head)."""
        self.table_writes.write_tokens(table_idx, start, tokens)

    @torch.inference_mode()
    def forward(self, batch: Batch, samples: list[bool] | None = None) -> torch.Tensor:
        """Run the model; logits [B, vocab] (float32) of each request's last computed token."""
        return self.forward_step(batch, samples or [False] * batch.size).logits.float()

    @torch.inference_mode()
    def forward_step(self, batch: Batch, samples: list[bool]) -> ForwardOutput:
        """Phase 1 of a step: queue the forward (and, in a CUDA graph, the sampling of every
        request whose `samples` flag is set). Nothing here waits for the device."""
        self.table_writes.flush()
        reqs = batch.reqs
        adjusted, filtered = any_adjusted(reqs), any_filter(reqs, self.model_config.vocab_size)
        # the ids sample_step draws again after changing the logits: the graph skips them
        resample = adjusted or filtered or any(r.grammar is not None for r in reqs)
        out = self._forward(batch, samples, resample)
        out.adjusted, out.filtered = adjusted, filtered
        if resample:
            out.sampled = None
        return out

    @property
    def needs_warm_up(self) -> bool:
        """Kernels compile at first use: Triton's and FlashInfer's on CUDA, the decoder's
        graph under --enable-torch-compile (eager CPU has nothing to compile)."""
        return self.device.type == "cuda" or self.compiled_decoder is not None

    def decoder(self, batch: Batch) -> torch.nn.Module:
        """The decoder that runs `batch`: the compiled one for a one-request decode step
        (--enable-torch-compile), else the model's own."""
        if self.compiled_decoder is not None and batch.is_decode and batch.size == 1:
            return self.compiled_decoder
        return self.model.model

    def _forward(self, batch: Batch, samples: list[bool], resample: bool) -> ForwardOutput:
        if self.graphs is not None:
            if self.graphs.can_run(batch):
                return self.graphs.replay(batch, samples, resample)
            if (flat := flat_batch(batch, self.graphs.max_bs)) is not None:
                out = self.graphs.replay(flat, [True] * flat.size, resample)
                out.flat = flat
                return out
            if self.prefill_as_rows and (rows := prefill_rows(batch, self.graphs.max_bs)):
                return self._replay_rows(batch, rows, samples, resample)
        host = StepInputs.pack(batch.reqs, samples, self.dummy_row, self.device)
        inputs = StepInputs.unpack(host.to(self.device, non_blocking=True), batch.size)
        self.attn_backend.prepare(batch)
        out = run_step(self, batch, inputs, sample=False)
        if not batch.is_decode and out.hidden is not None:
            out.prompt_logprobs = PromptLogprobs.compute(self, batch, out.hidden)
        return out

    def _replay_rows(
        self, batch: Batch, rows: Batch, samples: list[bool], resample: bool
    ) -> ForwardOutput:
        """`batch` replayed as `rows` (one per position, `prefill_rows`): each request's last
        row samples for it (to its own token-table row, as the eager step would), the others
        to the dummy row, so the prompt's tokens in the table stay. The outputs of the last
        rows, one per request, as the eager step gives them."""
        flags: list[bool] = []
        lasts: list[int] = []
        for req, samples_here in zip(batch.reqs, samples):
            flags += [False] * (req.extend_len - 1) + [samples_here]
            lasts.append(len(flags) - 1)
        assert self.graphs is not None
        out = self.graphs.replay(rows, flags, resample)
        return out.pick(to_device(lasts, torch.int64, self.device))

    @torch.inference_mode()
    def sample_step(
        self, batch: Batch, out: ForwardOutput, mask: TokenMask | None = None
    ) -> StepOutput:
        """Phase 2: sample what the forward did not (filters, grammar `mask`, adjusted logits,
        eager batches); the ids go into the token table (where the next step reads its inputs)
        and into pinned host memory. Nothing here waits for the device."""
        self.table_writes.flush()  # token writes since the forward land before this step's ids
        if out.flat is not None:  # one row per position (verify.flat_batch)
            flat_ids, _ = self._sample_ids(out.flat, out, None)
            verification, next_ids = Verification.from_flat(batch, flat_ids)
            return StepOutput.start_copy(next_ids, None, None, verification)
        next_ids, logprobs = self._sample_ids(batch, out, mask)
        # rows with proposals (speculative decoding) are extends: never in a decode batch
        verification = None if batch.is_decode else Verification.start(self, batch, out)
        return StepOutput.start_copy(next_ids, logprobs, out.prompt_logprobs, verification)

    def _sample_ids(
        self, batch: Batch, out: ForwardOutput, mask: TokenMask | None
    ) -> tuple[torch.Tensor, SampledLogprobs | None]:
        """The step's sampled ids (written into the token table) and logprobs being computed."""
        next_ids, reqs = out.sampled, batch.reqs
        adjusted, filtered = out.adjusted, out.filtered
        # raw: read before the mask and the adjustments change the logits in place
        logprobs = SampledLogprobs.start(batch, out.logits, mask is not None or adjusted)
        if next_ids is None or mask is not None or adjusted or filtered:
            grammar_only = None
            if mask is not None:
                apply_token_bitmask(out.logits, mask)
                grammar_only = out.logits.clone() if adjusted else None
            if adjusted:
                penalized = [
                    (r.table_idx, r.cached_len + r.extend_len)
                    for r in reqs
                    if r.params.uses_penalties
                ]
                rows, kv_lens = out.inputs.rows, out.kv_lens
                adjust_logits(
                    out.logits, self.adjustments, rows, kv_lens, self.token_table, penalized
                )
            if grammar_only is not None:
                grammar_over_min_tokens(out.logits, grammar_only)
            next_ids = self._sample(reqs, out, filtered)
            self.token_table[out.inputs.write_rows, out.kv_lens] = next_ids.to(torch.int32)
        if logprobs is not None:
            logprobs.finish(next_ids)
        return next_ids, logprobs

    def _sample(self, reqs: list[Req], out: ForwardOutput, filtered: bool) -> torch.Tensor:
        """Eager sampling from `out.logits`: with the host-built filter arguments only when a
        request uses top-k, top-p or min-p; else from the step's own inputs on the device."""
        if filtered:  # each row's step: the position it samples (as the graph's kv_lens)
            steps = [r.cached_len + r.extend_len for r in reqs]
            args = BatchSamplingArgs.from_reqs(
                reqs, self.model_config.vocab_size, self.device, steps
            )
            return sample(out.logits, args)
        if all(r.params.is_greedy for r in reqs):
            return greedy(out.logits)
        inputs = out.inputs
        return sample_at_temperature(out.logits, inputs.temperatures, inputs.seeds, out.kv_lens)

    def track_adjustments(self, req: Req, eos_token_ids: Collection[int]) -> None:
        """A request was admitted to its page-table row: its logit adjustments go there."""
        self.adjustments.write(req.table_idx, req, eos_token_ids)

    @property
    def prefill_graph_rows(self) -> int:
        """How many tokens a prefill or mixed step may hold to replay the graphs (0: never)."""
        return self.graphs.max_bs if self.graphs is not None and self.prefill_as_rows else 0

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
            logger.warning(
                "attention backend %s has no CUDA-graph support: graphs off", self.config.attn
            )
            return None
        return GraphRunner(self, max_bs)

    def shutdown(self) -> None:
        self.graphs = None
        set_global_ctx(None)


class StepOutput:
    """Sampled token ids (and the log-probabilities asked for) on their way to the host: the
    copies are queued behind the step's kernels and reading them waits only for those."""

    def __init__(
        self,
        host: torch.Tensor,
        event: torch.cuda.Event | None,
        logprobs: SampledLogprobs | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
        verification: Verification | None = None,
    ) -> None:
        self.host, self.event = host, event
        self.sampled_logprobs, self.prompt = logprobs, prompt_logprobs
        self.verification = verification

    @staticmethod
    def start_copy(
        next_ids: torch.Tensor,
        logprobs: SampledLogprobs | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
        verification: Verification | None = None,
    ) -> StepOutput:
        if next_ids.device.type != "cuda":
            return StepOutput(next_ids, None, logprobs, prompt_logprobs, verification)
        host = torch.empty(next_ids.shape, dtype=next_ids.dtype, pin_memory=True)
        host.copy_(next_ids, non_blocking=True)
        verification = verification.to_host() if verification is not None else None
        event = torch.cuda.Event()
        event.record()
        return StepOutput(host, event, logprobs, prompt_logprobs, verification)

    def tokens(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()

    def logprobs(self) -> list[Entry | None] | None:
        """Per batch row, the sampled token's entry when the request asked for logprobs; None
        when no request of the step did."""
        lp = self.sampled_logprobs
        if lp is None or lp.result is None:
            return None
        self.tokens()  # waits for the copies
        entries: list[Entry | None] = list(lp.result.entries(lp.ks))
        if lp.index is None:  # every row asked
            return entries
        out: list[Entry | None] = [None] * len(self.host)
        for row, entry in zip(lp.rows, entries):
            out[row] = entry
        return out

    def verified(self) -> dict[int, list[int]]:
        """Per batch row with proposals, the target's token at each of its positions."""
        if self.verification is None:
            return {}
        self.tokens()
        return self.verification.by_row()

    def prompt_logprobs(self) -> dict[int, list[Entry]]:
        """Per batch row that computed some, its prompt positions' entries."""
        if self.prompt is None:
            return {}
        self.tokens()
        return self.prompt.by_row()
