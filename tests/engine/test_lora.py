"""Multi-LoRA (ext/lora), CPU float32, through `LLM`: greedy output per request equals
transformers + PEFT's merged model for the base model and two adapters mixed in one batch, for
the five architectures (qwen3_moe: adapters on attention and its dense MLP, not the experts);
the prefix cache shares no KV between the base model and an adapter; slots shared by more
adapters than fit; TP=2; the offline errors. The TP shards of each projection's LoRA add up to the
unsharded result."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.distributed import DistributedInfo, set_tp_info
from minisgl.ext.lora import LoRARequest
from minisgl.ext.lora.adapter import MODULES
from minisgl.ext.lora.layers import install
from minisgl.ext.lora.manager import LoraManager
from minisgl.ext.lora.options import LoraOptions
from minisgl.ext.lora.weights import LoraStack, part_bounds
from minisgl.models.config import ModelConfig
from minisgl.models.hf import load_hf_config
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.weight import iter_checkpoint, load_weights
from support.invariants import check_no_leak
from support.lora import save_adapter
from support.models import hf_greedy

MAX_NEW = 10
PROMPTS = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3], [7, 7, 8, 100, 200, 3, 9], [11, 40, 2, 2, 90, 17, 5, 8]]
ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral"]
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
# qwen3_moe: attention only (adapters on the experts are refused; PEFT saves an MLP target of
# this model as expert parameters)
MOE = {
    "a1": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "a2": dict(target_modules=["q_proj", "v_proj", "o_proj"], alpha_pattern={"o_proj": 3}),
}


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    """arch -> ({name: adapter dir}, {name: merged HF model, "base": the HF model})."""
    cache = {}

    def get(arch: str):
        if arch not in cache:
            _, hf = model_dirs(arch)
            dirs, refs = {}, {"base": hf}
            for i, (name, lora) in enumerate(ADAPTERS.items()):
                if arch == "qwen3_moe":
                    lora = {**lora, **MOE[name]}
                dirs[name] = str(tmp_path_factory.mktemp(f"{arch}-{name}"))
                refs[name] = save_adapter(arch, dirs[name], seed=i + 1, **lora)
            cache[arch] = (dirs, refs)
        return cache[arch]

    return get


def _llm(model_dirs, arch: str, dirs: dict[str, str], **options) -> LLM:
    """a1 served from the start; a2 comes with its first LoRARequest."""
    path, _ = model_dirs(arch)
    lora = dict(max_loras=2, max_lora_rank=16, lora_modules=[f"a1={dirs['a1']}"])
    return LLM(path, page_size=4, num_pages=128, enable_lora=True, **{**lora, **options})


def _run(llm: LLM, names: list[str], prompts: list[list[int]], dirs: dict[str, str]):
    requests = [
        None if n == "base" else LoRARequest(n, i + 1, dirs[n]) for i, n in enumerate(names)
    ]
    params = SamplingParams(max_tokens=MAX_NEW)
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=requests)
    return [o["token_ids"] for o in outs]


def _run_exact(llm: LLM, names: list[str], prompts: list[list[int]], dirs, refs):
    """`_run`, each request's tokens checked against its own merged model's greedy output."""
    got = _run(llm, names, prompts, dirs)
    for name, prompt, tokens in zip(names, prompts, got):
        assert tokens == hf_greedy(refs[name], prompt, MAX_NEW), name
    return got


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_batch_equals_peft_merged(model_dirs, adapters, arch):
    """Base, a1 and a2 in one batch (the same prompt under all three, with the radix cache
    on): each request's greedy tokens are those of its own merged model."""
    dirs, refs = adapters(arch)
    llm = _llm(model_dirs, arch, dirs)
    try:
        names = ["base", "a1", "a2", "a1", "a2", "base"]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2]]
        got = _run_exact(llm, names, prompts, dirs, refs)
        assert got[0] != got[1] and got[0] != got[2] and got[1] != got[2]  # it can fail
        check_no_leak(llm.scheduler)
    finally:
        llm.shutdown()


def test_tp2_mixed_batch_equals_peft_merged(model_dirs, adapters):
    """TP=2 (gloo on CPU): each rank's shard of every adapter, one slot taken in turns (rank 0
    pins when it admits, the follower at rank 0's word), same tokens as PEFT's merged models."""
    dirs, refs = adapters("llama")
    path, _ = model_dirs("llama")
    modules = [f"{name}={where}" for name, where in dirs.items()]
    llm = LLM(path, tp=2, page_size=4, num_pages=128, enable_lora=True, lora_modules=modules)
    try:
        names = ["base", "a1", "a2", "a1", "a2"]
        prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[2]]
        _run_exact(llm, names, prompts, dirs, refs)
        with pytest.raises(ValueError, match="served from the start"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest("new", 9, dirs["a1"]))
    finally:
        llm.shutdown()


def test_prefix_cache_keyed_by_adapter(model_dirs, adapters):
    """The same prompt through the base model, then a1, then a1 again: a1's first run finds
    nothing of the base model's KV in the prefix cache (its own answer), its second run finds
    its own."""
    dirs, refs = adapters("llama")
    llm = _llm(model_dirs, "llama", dirs)
    try:
        prompt = PROMPTS[0] * 2  # four full pages of 4 tokens to share
        base = _run(llm, ["base"], [prompt], dirs)[0]
        before = llm.num_cached_tokens
        first = _run(llm, ["a1"], [prompt], dirs)[0]
        assert llm.num_cached_tokens == before  # nothing shared with the base model
        assert first == hf_greedy(refs["a1"], prompt, MAX_NEW) != base
        again = _run(llm, ["a1"], [prompt], dirs)[0]
        assert llm.num_cached_tokens > before and again == first  # shared within a1
        assert _run(llm, ["base"], [prompt], dirs)[0] == base
        check_no_leak(llm.scheduler)
    finally:
        llm.shutdown()


def test_more_adapters_than_slots(model_dirs, adapters):
    """max_loras=1: the requests of a1 and a2 take turns in the one slot (a request waits for
    it while the other adapter's run), each still exact."""
    dirs, refs = adapters("qwen3")
    llm = _llm(model_dirs, "qwen3", dirs, max_loras=1)
    try:
        names = ["a1", "a2", "base", "a1", "a2"]
        prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[2], PROMPTS[0]]
        _run_exact(llm, names, prompts, dirs, refs)
        manager = next(f for f in llm.scheduler.features if f.name == "lora").manager
        assert not any(manager.slots.pins.values())  # every pin released
        check_no_leak(llm.scheduler)
    finally:
        llm.shutdown()


def test_offline_errors(model_dirs, adapters, tmp_path):
    dirs, _ = adapters("llama")
    path, _ = model_dirs("llama")
    llm = _llm(model_dirs, "llama", dirs, max_lora_rank=8)
    try:
        with pytest.raises(ValueError, match="'nope': not served, and no lora_path"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest("nope", 1), use_tqdm=False)
        with pytest.raises(ValueError, match="already served from"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest("a1", 1, dirs["a2"]))
        big = str(tmp_path / "big")
        save_adapter("llama", big, seed=3, r=16)
        with pytest.raises(ValueError, match="rank 16 is over max_lora_rank 8"):
            llm.generate([PROMPTS[0]], lora_request=LoRARequest("big", 1, big))
        with pytest.raises(ValueError, match="unknown LoRA adapter 'big'"):  # nothing kept
            llm.generate([PROMPTS[0]], SamplingParams(lora_name="big"), use_tqdm=False)
        with pytest.raises(ValueError, match="2 lora_request for 1 prompts"):
            llm.generate([PROMPTS[0]], lora_request=[None, None])
        assert _run(llm, ["base"], [PROMPTS[1]], dirs)  # still serving
        check_no_leak(llm.scheduler)
    finally:
        llm.shutdown()
    plain = LLM(path, page_size=4, num_pages=64)
    try:
        with pytest.raises(ValueError, match="enable_lora=True"):
            plain.generate([PROMPTS[0]], lora_request=LoRARequest("a1", 1, dirs["a1"]))
        with pytest.raises(ValueError, match="needs --enable-lora"):
            plain.generate([PROMPTS[0]], SamplingParams(lora_name="a1"), use_tqdm=False)
    finally:
        plain.shutdown()


def _rank_model(path: str, rank: int, size: int, adapters: list[str]):
    """The model as TP rank `rank` of `size` builds it, weights and adapters loaded, LoRA
    installed with every token on `slots` (returned)."""
    set_tp_info(DistributedInfo(rank, size))
    try:
        cfg = ModelConfig.from_hf(load_hf_config(path))
        model = LlamaForCausalLM(cfg)
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


def test_joint_matrix_holds_every_slot_a_then_the_weight(model_dirs, tmp_path):
    """Each projection's `joint` (the decode GEMV's matrix) is every slot's A, then the layer's
    weight, which is a view of it with its loaded values: x joint^T is x A_s^T of every slot
    beside x W^T, what `lora_expand_joint` reads; an adapter's slot fills its A rows there."""
    path, _ = model_dirs("llama")
    save_adapter("llama", str(tmp_path / "a1"), seed=1, **ADAPTERS["a1"])
    model = LlamaForCausalLM(ModelConfig.from_hf(load_hf_config(path)))
    load_weights(model, iter_checkpoint(path))
    loaded = {id(m): m.weight.clone() for m in model.modules() if hasattr(m, "weight")}
    stack = LoraStack(model, 2, 16)
    options = LoraOptions(True, (f"a1={tmp_path / 'a1'}",), max_loras=2, max_lora_rank=16)
    LoraManager(options, model.config, stack).acquire("a1")  # slot 1
    x = torch.randn(3, model.config.hidden_size)
    for proj in stack.projections.values():
        weight, joint = proj.module.weight, proj.joint
        assert joint is not None and weight.data_ptr() == joint[-weight.shape[0] :].data_ptr()
        assert proj.a.data_ptr() == joint.data_ptr()
        torch.testing.assert_close(weight, loaded[id(proj.module)], atol=0, rtol=0)
        assert proj.a[1].abs().sum() > 0 and proj.a[0].abs().sum() == 0 == proj.a[2].abs().sum()
        if weight.shape[1] == x.shape[1]:
            out = x @ joint.T
            lead = proj.a.shape[0] * proj.a.shape[1]
            torch.testing.assert_close(out[:, lead:], x @ weight.T)
            torch.testing.assert_close(out[:, :lead], x @ proj.a.flatten(0, 1).T)


@pytest.mark.parametrize("max_bytes", [None, 0])
def test_joint_gemv_only_where_it_computes_the_layer_and_pays(model_dirs, monkeypatch, max_bytes):
    """Qwen2's qkv has a bias, which the joint GEMV leaves out: its qkv keeps the shrink path,
    the other projections take the joint one, unless their A is over JOINT_MAX_BYTES."""
    from minisgl.ext.lora import layers

    if max_bytes is not None:
        monkeypatch.setattr(layers, "JOINT_MAX_BYTES", max_bytes)
    path, _ = model_dirs("qwen2")
    model = LlamaForCausalLM(ModelConfig.from_hf(load_hf_config(path)))
    stack = LoraStack(model, 2, 16)
    install(model, stack, lambda n: torch.zeros(n, dtype=torch.int32))
    joint = {name: proj.joint is not None for (_, name), proj in stack.projections.items()}
    assert joint == {n: max_bytes is None and n != "qkv_proj" for n in MODULES}
