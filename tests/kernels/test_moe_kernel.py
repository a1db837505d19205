"""The fused Triton MoE (kernel/moe.py) against the torch reference `moe_forward_torch`: on CPU
tiny shapes under the Triton interpreter (TRITON_INTERPRET=1), on CUDA Qwen3-30B-A3B shapes and
a tiny Qwen3-MoE engine. Skipped where triton is not installed; `--moe-backend` validation tests
always run."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl import LLM, SamplingParams
from minisgl.engine import EngineConfig
from minisgl.kernel import resolve_moe_backend
from minisgl.layers.moe import MoELayer, moe_forward_torch
from minisgl.server.args import parse_args
from support.triton_env import kernel_module, use_interpreter_on_cpu

CUDA = torch.cuda.is_available()
use_interpreter_on_cpu()  # before anything imports triton
DEVICE = torch.device("cuda" if CUDA else "cpu")


@pytest.fixture(scope="module")
def moe():
    return kernel_module("moe")


def problem(tokens, experts, top_k, hidden, inter, dtype, seed, route=None):
    """x, w13, w2 and a router's normalised top-k (as MoELayer computes it); `route` [T, k]
    overrides the chosen experts."""
    gen = torch.Generator(DEVICE).manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE)  # noqa: E731
    x = randn(tokens, hidden)
    w13 = randn(experts, 2 * inter, hidden) / hidden**0.5
    w2 = randn(experts, hidden, inter) / inter**0.5
    probs = torch.softmax(randn(tokens, experts), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if route is not None:
        ids = torch.as_tensor(route, dtype=torch.int64, device=DEVICE).view(tokens, top_k)
        weights = probs.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return x.to(dtype), w13.to(dtype), w2.to(dtype), weights.to(dtype), ids


def check(out: torch.Tensor, ref: torch.Tensor) -> None:
    """fp32: the same math in another order; 16-bit: the reference rounds after every op (and
    accumulates the top-k sum in the dtype), the kernel once from float32."""
    assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape, out.dtype)
    if out.numel() == 0:
        return
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}[out.dtype]
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    assert err <= tol * max(scale, 1.0), f"max error {err:.3g} > {tol} x scale {scale:.3g}"


# (tokens, experts, top_k, hidden, intermediate): hidden / 2*inter not multiples of the tiles;
# the last ones have more pairs than 16 per expert, so they take the BLOCK_M=64 config
SHAPES = [
    (1, 4, 1, 32, 16),
    (1, 6, 2, 48, 40),
    (9, 5, 2, 64, 48),
    (17, 3, 1, 40, 24),
    (40, 2, 1, 32, 16),
    (24, 3, 2, 48, 32),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_torch(moe, shape, dtype):
    x, w13, w2, weights, ids = problem(*shape, dtype=dtype, seed=sum(shape))
    check(moe.fused_moe(x, w13, w2, weights, ids), moe_forward_torch(x, w13, w2, weights, ids))


@pytest.mark.parametrize(
    "name, tokens, experts, top_k, route",
    [
        ("all to one expert", 6, 5, 1, [3] * 6),
        ("all to one pair", 5, 4, 2, [2, 0] * 5),
        ("two of seven experts", 7, 7, 2, [[0, 5], [5, 0]] * 3 + [[0, 5]]),
        ("last expert only", 3, 9, 1, [8, 8, 8]),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skewed_routing(moe, name, tokens, experts, top_k, route, dtype):
    """Experts without tokens and experts with every token."""
    x, w13, w2, weights, ids = problem(tokens, experts, top_k, 32, 24, dtype, seed=7, route=route)
    check(moe.fused_moe(x, w13, w2, weights, ids), moe_forward_torch(x, w13, w2, weights, ids))


def test_no_tokens(moe):
    x, w13, w2, weights, ids = problem(0, 4, 2, 32, 16, torch.float32, seed=0)
    out = moe.fused_moe(x, w13, w2, weights, ids)
    assert out.shape == (0, 32) and out.dtype == torch.float32


def test_shape_mismatch_is_named(moe):
    x, w13, w2, weights, ids = problem(2, 4, 2, 32, 16, torch.float32, seed=0)
    with pytest.raises(AssertionError, match="fused_moe"):
        moe.fused_moe(x, w13, w2[:, :, :8], weights, ids)


@settings(max_examples=60, deadline=None)
@given(
    tokens=st.integers(0, 40),
    experts=st.integers(1, 9),
    top_k=st.integers(1, 3),
    block_m=st.sampled_from([1, 4, 16]),
    seed=st.integers(0, 2**16),
)
def test_align_block_size_invariants(moe, tokens, experts, top_k, block_m, seed):
    gen = torch.Generator().manual_seed(seed)
    # any ids, repeats within a row included: alignment must not rely on top-k being distinct
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    aligned = moe.align_block_size(ids.to(DEVICE), experts, block_m)
    sorted_ids, expert_ids, num_post = (t.cpu() for t in aligned)
    assert sorted_ids.dtype == expert_ids.dtype == num_post.dtype == torch.int32
    pairs, flat = tokens * top_k, ids.flatten()
    used = int(num_post.item())
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())
    assert used % block_m == 0 and used <= sorted_ids.numel()
    assert expert_ids.numel() == sorted_ids.numel() // block_m
    # every pair exactly once, in the used prefix; everything else is padding
    valid = sorted_ids[:used][sorted_ids[:used] < pairs]
    assert sorted(valid.tolist()) == list(range(pairs))
    assert bool((sorted_ids[used:] == pairs).all())
    assert bool((sorted_ids[:used] <= pairs).all())
    blocks = sorted_ids[:used].view(-1, block_m)
    for b, block in enumerate(blocks.tolist()):
        expert = int(expert_ids[b])
        members = [i for i in block if i < pairs]
        assert members, "a used block holds at least one pair"
        assert all(int(flat[i]) == expert for i in members), "a block is single-expert"
        assert block[: len(members)] == sorted(members), "pairs first, in flat order; then pads"
    assert expert_ids[: used // block_m].tolist() == sorted(expert_ids[: used // block_m].tolist())
    assert bool((expert_ids[used // block_m :] == experts).all())


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]


PROMPTS = [[5, 9, 100, 3, 77, 41, 8], [300, 2], [17] * 12]


def test_engine_moe_layers_with_the_kernel_on_cpu(moe, model_dirs):
    """A tiny Qwen3-MoE: greedy tokens with every MoE layer on the interpreted kernel equal the
    torch reference's (the engine refuses triton on CPU, so the layers are switched by hand)."""
    if CUDA:
        pytest.skip("the GPU test below runs the kernel through --moe-backend triton")
    llm = LLM(model_dirs("qwen3_moe")[0], device="cpu", page_size=4, num_pages=64)
    try:
        layers = [m for m in llm.engine.model.modules() if isinstance(m, MoELayer)]
        assert layers and all(m.run_experts is moe_forward_torch for m in layers)
        ref = _greedy(llm, PROMPTS)
        for m in layers:
            m.run_experts = moe.fused_moe
        assert _greedy(llm, PROMPTS) == ref
    finally:
        llm.shutdown()


# ---- --moe-backend: the choice and its validation (no triton needed) ----


def test_resolve_moe_backend(monkeypatch):
    import minisgl.kernel as kernel

    assert resolve_moe_backend("auto", "cpu") == "torch"
    assert resolve_moe_backend("torch", "cuda") == "torch"
    with pytest.raises(ValueError, match="--moe-backend triton needs a CUDA device"):
        resolve_moe_backend("triton", "cpu")
    with pytest.raises(ValueError, match="invalid --moe-backend 'fused'"):
        resolve_moe_backend("fused", "cuda")
    monkeypatch.setattr(kernel, "triton_available", lambda: False)
    assert resolve_moe_backend("auto", "cuda") == "torch"
    with pytest.raises(ValueError, match="--moe-backend triton needs the triton package"):
        resolve_moe_backend("triton", "cuda")
    monkeypatch.setattr(kernel, "triton_available", lambda: True)
    assert resolve_moe_backend("auto", "cuda") == "triton"
    assert resolve_moe_backend("triton", "cuda") == "triton"


def test_moe_backend_flag():
    assert parse_args([]).engine.moe_backend == "auto"
    assert parse_args(["--moe-backend", "torch"]).engine.moe_backend == "torch"
    with pytest.raises(SystemExit) as e:
        parse_args(["--moe-backend", "cuda"])
    assert e.value.code == 2


@pytest.mark.skipif(CUDA, reason="checks the refusal on a CPU engine")
def test_triton_refused_on_cpu_before_loading(tmp_path):
    with pytest.raises(ValueError, match="--moe-backend triton needs a CUDA device"):
        EngineConfig(model=str(tmp_path), device="cpu", moe_backend="triton")
    # through LLM: the error comes before the (missing) model is read
    with pytest.raises(ValueError, match="--moe-backend triton"):
        LLM(str(tmp_path), device="cpu", moe_backend="triton")
    with pytest.raises(ValueError, match="invalid --moe-backend"):
        LLM(str(tmp_path), device="cpu", moe_backend="Triton")


def test_cpu_engine_picks_torch_experts(model_dirs):
    llm = LLM(model_dirs("qwen3_moe")[0], device="cpu", page_size=4, num_pages=16)
    try:
        assert llm.engine.model_config.moe.backend == "torch"
        assert llm.engine.graphs is None
    finally:
        llm.shutdown()


# ---- GPU: Qwen3-30B-A3B shapes, and the engine with the kernel ----


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 7, 256, 4096])
def test_fused_moe_qwen3_30b_a3b_shapes(moe, tokens):
    x, w13, w2, weights, ids = problem(tokens, 128, 8, 2048, 768, torch.bfloat16, seed=tokens)
    check(moe.fused_moe(x, w13, w2, weights, ids), moe_forward_torch(x, w13, w2, weights, ids))


@pytest.mark.gpu
def test_fused_moe_captured_in_a_cuda_graph(moe):
    """No host sync: the kernel captures, and a replay after new routing follows the routing."""
    x, w13, w2, weights, ids = problem(8, 16, 2, 256, 64, torch.bfloat16, seed=1)
    moe.fused_moe(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe.fused_moe(x, w13, w2, weights, ids)
    _, _, _, new_weights, new_ids = problem(8, 16, 2, 256, 64, torch.bfloat16, seed=2)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    check(out, moe_forward_torch(x, w13, w2, weights, ids))


def _gpu_prompts(n: int = 16) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(2, 40))] for _ in range(n)]


@pytest.mark.gpu
def test_engine_triton_equals_torch_and_graphs_equal_eager(moe, model_dirs):
    """Tiny Qwen3-MoE in fp32 on the GPU: --moe-backend triton (CUDA graphs on) gives the torch
    backend's greedy tokens, and so does triton with graphs off."""
    path = model_dirs("qwen3_moe")[0]
    outputs = {}
    for backend, max_bs in [("torch", 16), ("triton", 16), ("triton", 0)]:
        llm = LLM(
            path,
            device="cuda:0",
            dtype="float32",
            moe_backend=backend,
            cuda_graph_max_bs=max_bs,
            page_size=16,
            num_pages=256,
        )
        try:
            assert llm.engine.model_config.moe.backend == backend
            # graphs only where the expert computation has no host sync
            assert (llm.engine.graphs is not None) == (backend == "triton" and max_bs > 0)
            outputs[backend, max_bs] = _greedy(llm, _gpu_prompts(), max_tokens=12)
        finally:
            llm.shutdown()
    assert outputs["triton", 16] == outputs["torch", 16]
    assert outputs["triton", 16] == outputs["triton", 0]
