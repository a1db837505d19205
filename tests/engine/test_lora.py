"""Multi-LoRA (ext/lora), CPU float32: minisgl's model with the LoRA transform equals
transformers + PEFT's merged model for each adapter, alone and with the base model and both
adapters mixed in one batch; the TP shards of each projection's LoRA add up to the unsharded
result. The transform is installed by hand here (the engine does not build it yet) and the
test writes the per-token slot indices the engine's step will write."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, set_global_ctx
from minisgl.distributed import DistributedInfo, set_tp_info
from minisgl.ext.lora.layers import LoraModelTransform, install
from minisgl.ext.lora.manager import LoraManager
from minisgl.ext.lora.options import LoraOptions
from minisgl.ext.lora.weights import LoraStack, part_bounds
from minisgl.models import ModelConfig, get_model_class
from minisgl.models.hf import load_hf_config
from minisgl.models.weight import iter_checkpoint, load_weights
from support.lora import save_adapter
from support.models import hf_greedy

MAX_NEW = 10
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 7, 8, 100, 200, 3, 9], [11, 40, 2, 2, 90, 17, 5, 8]]
# a1: every projection, r 8, alpha 16; a2: some, rslora, per-module rank and alpha (PEFT's
# rank_pattern / alpha_pattern)
ADAPTERS = {
    "a1": dict(),
    "a2": dict(
        r=4,
        lora_alpha=8,
        use_rslora=True,
        target_modules=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
        rank_pattern={"v_proj": 2},
        alpha_pattern={"down_proj": 3},
    ),
}


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    """arch -> (its LLM with the LoRA transform, transform, manager, {name: merged HF model})."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            path, hf = model_dirs(arch)
            refs, modules = {"base": hf}, []
            for i, (name, lora) in enumerate(ADAPTERS.items()):
                where = str(tmp_path_factory.mktemp(f"{arch}-{name}"))
                refs[name] = save_adapter(arch, where, seed=i + 1, **lora)
                modules.append(f"{name}={where}")
            # no prefix sharing: the prefix cache is not keyed by adapter yet
            llm = LLM(path, page_size=4, num_pages=128, cache="naive")
            transform = LoraModelTransform(2, 16, 256, torch.device("cpu"))
            transform.after_load(llm.engine.model)
            assert transform.stack is not None
            options = LoraOptions(True, tuple(modules), max_loras=2, max_lora_rank=16)
            manager = LoraManager(options, llm.engine.model_config, transform.stack)
            cache[arch] = (llm, transform, manager, refs)
        set_global_ctx(cache[arch][0].engine.ctx)  # the engine built last set its own
        return cache[arch]

    return get


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_equals_peft_merged(served, arch):
    llm, transform, manager, refs = served(arch)
    outputs = {}
    for name, ref in refs.items():
        slot = 0 if name == "base" else manager.acquire(name)
        transform.token_slots.fill_(slot)  # every token of every step on this adapter
        try:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_NEW), use_tqdm=False)
        finally:
            transform.token_slots.zero_()
            if name != "base":
                manager.release(name)
        outputs[name] = [o["token_ids"] for o in outs]
        assert outputs[name] == [hf_greedy(ref, p, MAX_NEW) for p in PROMPTS], name
    for name in ADAPTERS:  # the adapters change the answers (or this test could not fail)
        assert outputs[name] != outputs["base"]


def _prefill(llm, prompts):
    sched = llm.scheduler
    reqs = [sched.make_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    for req in reqs:  # admitted by hand: one prefill forward of the whole batch
        sched.planner.admit(req)
        assert sched.planner.grow(req, req.remaining_len)
        req.extend_len = req.remaining_len
    return reqs


def _set_slots(transform, slots, lengths):
    per_token = [s for s, n in zip(slots, lengths) for _ in range(n)]
    transform.token_slots.zero_()
    transform.token_slots[: len(per_token)] = torch.tensor(per_token, dtype=torch.int32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_one_batch_mixes_base_and_adapters(served, arch):
    """Prefill then decode of base, a1, a2, a1 in one batch: each request's logits are those of
    its own model (the slot of each token picks its adapter)."""
    llm, transform, manager, refs = served(arch)
    engine, sched = llm.engine, llm.scheduler
    names = ["base", "a1", "a2", "a1"]
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]]
    slots = [0 if n == "base" else manager.acquire(n) for n in names]
    reqs = _prefill(llm, prompts)
    try:
        _set_slots(transform, slots, [r.extend_len for r in reqs])
        logits = engine.forward(Batch(reqs, "prefill"))
        with torch.no_grad():
            for i, (name, p) in enumerate(zip(names, prompts)):
                ref = refs[name](torch.tensor([p])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
        for req, tok in zip(reqs, logits.argmax(-1).tolist()):
            req.cached_len, req.extend_len = len(req.tokens), 1
            req.tokens.append(tok)
            engine.set_tokens(req.table_idx, req.tokens)
            assert sched.planner.grow(req, 1)
        _set_slots(transform, slots, [1] * len(reqs))
        logits = engine.forward(Batch(reqs, "decode"))
        with torch.no_grad():
            for i, (name, req) in enumerate(zip(names, reqs)):
                ref = refs[name](torch.tensor([req.tokens])).logits[0, -1]
                torch.testing.assert_close(logits[i], ref, atol=1e-4, rtol=0)
    finally:
        transform.token_slots.zero_()
        for req in reqs:
            req.cached_len = len(req.tokens)
            sched.planner.release(req)
        for name in names[1:]:
            manager.release(name)
    sched.check_no_leak()


def _rank_model(path: str, rank: int, size: int, adapters: list[str]):
    """The model as TP rank `rank` of `size` builds it, weights and adapters loaded, LoRA
    installed with every token on `slots` (returned)."""
    set_tp_info(DistributedInfo(rank, size))
    try:
        cfg = ModelConfig.from_hf(load_hf_config(path))
        model = get_model_class(cfg.architecture)(cfg)
        load_weights(model, iter_checkpoint(path))
        stack = LoraStack(model, len(adapters), 16)
        options = LoraOptions(True, tuple(adapters), max_loras=len(adapters), max_lora_rank=16)
        manager = LoraManager(options, cfg, stack)
        for name in [a.partition("=")[0] for a in adapters]:
            manager.acquire(name)
        slots = torch.zeros(64, dtype=torch.int32)
        install(model, stack, lambda n: slots[:n])
        return model, slots
    finally:
        set_tp_info(DistributedInfo(0, 1))


def _split(y: torch.Tensor, bounds: list[int]) -> list[torch.Tensor]:
    return [y[:, lo:hi] for lo, hi in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("size", [2, 4])  # 4 > 2 KV heads: k/v replicated, not split
def test_tp_shards_add_up(model_dirs, tmp_path, size):
    """Each rank's LoRA on each projection, put together as TP puts the layer's outputs
    together (column-parallel: the parts' rows concatenated; row-parallel: the partial sums
    added, the all-reduce), equals the unsharded projection's, for tokens mixing the base and
    two adapters."""
    path, _ = model_dirs("llama")
    adapters = []
    for i, (name, lora) in enumerate(ADAPTERS.items()):
        save_adapter("llama", str(tmp_path / name), seed=i + 1, **lora)
        adapters.append(f"{name}={tmp_path / name}")
    full, full_slots = _rank_model(path, 0, 1, adapters)
    ranks = [_rank_model(path, r, size, adapters) for r in range(size)]
    gen = torch.Generator().manual_seed(0)
    tokens = torch.tensor([0, 1, 2, 2, 1, 0, 1], dtype=torch.int32)
    for _, slots in [(full, full_slots), *ranks]:
        slots[: len(tokens)] = tokens
    layer = 1
    for block, name in [("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")]:
        modules = [getattr(getattr(m.model.layers[layer], block), name) for m, _ in ranks]
        ref = getattr(getattr(full.model.layers[layer], block), name)
        x = torch.randn(len(tokens), ref.weight.shape[1], generator=gen)
        bounds = [part_bounds(m) for m in [ref, *modules]]
        assert not torch.allclose(ref(x), x @ ref.weight.T, atol=1e-3)  # the LoRA counts
        shards = [_split(m(x), b) for m, b in zip(modules, bounds[1:])]
        expected = _split(ref(x), bounds[0])
        for j, part in enumerate(expected):
            got = [s[j] for s in shards]
            if name == "qkv_proj" and j > 0 and size > 2:  # 2 KV heads, each on size/2 ranks
                got = got[:: size // 2]
            torch.testing.assert_close(torch.cat(got, dim=1), part, atol=1e-5, rtol=0)
    for block, name in [("self_attn", "o_proj"), ("mlp", "down_proj")]:
        modules = [getattr(getattr(m.model.layers[layer], block), name) for m, _ in ranks]
        ref = getattr(getattr(full.model.layers[layer], block), name)
        x = torch.randn(len(tokens), ref.weight.shape[1], generator=gen)
        pieces = x.chunk(size, dim=1)
        total = sum(m.matmul(p) for m, p in zip(modules, pieces))
        assert not torch.allclose(total, x @ ref.weight.T, atol=1e-3)  # the LoRA counts
        torch.testing.assert_close(total, ref.matmul(x), atol=1e-5, rtol=0)
