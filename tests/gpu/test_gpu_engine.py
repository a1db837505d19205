"""GPU engine paths against the plain ones: CUDA-graph decode vs eager, overlap scheduling on
vs off, the fused sampling kernel vs the torch sampler, the fused RoPE + KV store vs the torch
path."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.engine.sample import sample
from support.invariants import check_no_leak
from support.sampling import sampling_args

pytestmark = pytest.mark.gpu


def prompts(n: int = 24) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(2, 500) for _ in range(rng.randint(2, 60))] for _ in range(n)]


def generate(
    path: str,
    monkeypatch,
    overlap: bool = True,
    temperature: float = 0.7,
    graphs: bool | None = None,
    **kwargs,
) -> list[list[int]]:
    """Odd requests sample at `temperature` (every fifth with top-p too, which CUDA graphs
    leave to an eager resample), even ones are greedy. graphs: assert that CUDA graphs are on
    (True) or off (False) in the engine."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0" if overlap else "1")
    llm = LLM(path, device="cuda:0", page_size=16, num_pages=256, max_prefill_tokens=64, **kwargs)
    try:
        if graphs is not None:
            assert (llm.engine.graphs is not None) == graphs
        params = [
            SamplingParams(
                max_tokens=5 + i % 13,
                temperature=temperature * (i % 2),
                top_p=0.9 if i % 5 == 3 else 1.0,
                seed=i,
            )
            for i in range(24)
        ]
        outs = llm.generate(prompts(), params, use_tqdm=False)
        check_no_leak(llm.scheduler)
        return [o["token_ids"] for o in outs]
    finally:
        llm.shutdown()


def greedy_with_logprobs(path: str, monkeypatch, **kwargs) -> list[dict]:
    """The 24 prompts in bf16, greedy, with the top 5 logprobs of every generated token."""
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0")
    llm = LLM(
        path,
        device="cuda:0",
        page_size=16,
        num_pages=256,
        max_prefill_tokens=64,
        dtype="bfloat16",
        **kwargs,
    )
    try:
        params = [
            SamplingParams(max_tokens=5 + i % 13, temperature=0.0, logprobs=5) for i in range(24)
        ]
        outs = llm.generate(prompts(), params, use_tqdm=False)
        check_no_leak(llm.scheduler)
        return outs
    finally:
        llm.shutdown()


def assert_equal_up_to_near_ties(ref: list[dict], other: list[dict], tol: float = 0.1) -> None:
    """In bf16 another kernel (fi's prefill kernel computing a decode row) rounds differently,
    which can flip a greedy choice between two near-equal logits, after which the sequences
    part. So: equal up to the first difference, where the other run's token is within `tol` of
    the reference's top logprob, and most requests equal throughout."""
    exact = 0
    for r, o in zip(ref, other, strict=True):
        a, b = r["token_ids"], o["token_ids"]
        first = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if first is None:
            assert len(a) == len(b)
            exact += 1
            continue
        top = r["logprobs"][first]
        assert b[first] in top, f"token {b[first]} at {first} is not near the top: {top}"
        assert top[a[first]] - top[b[first]] < tol, f"not a near-tie at {first}: {top}"
    assert exact >= len(ref) // 2, f"only {exact} of {len(ref)} requests equal"


@pytest.mark.parametrize("attn", ["triton", "fi"])
def test_cuda_graph_decode_equals_eager(model_dirs, monkeypatch, attn):
    if attn == "fi":
        pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3" if attn == "triton" else "qwen3_hd128")
    dtype = "float32" if attn == "triton" else "bfloat16"
    eager = generate(path, monkeypatch, attn=attn, dtype=dtype, cuda_graph_max_bs=0)
    graphs = generate(path, monkeypatch, attn=attn, dtype=dtype, cuda_graph_max_bs=16)
    assert graphs == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pdl_on_equals_off(model_dirs, monkeypatch, dtype):
    """Programmatic dependent launch (kernel/pdl.py) changes when the Triton kernels start,
    never what they compute: the same tokens (greedy and sampled rows) with MINISGL_DISABLE_PDL=1
    and without, decode in CUDA graphs through the GEMV, norms, RoPE + store, split-KV
    attention and sampling kernels. A kernel that read its input before the previous kernel
    finished would change them."""
    from minisgl.kernel import pdl

    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs an sm_90+ GPU")
    path, _ = model_dirs("qwen3_hd128")
    kw = dict(attn="triton", dtype=dtype, cuda_graph_max_bs=16, graphs=True)
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "1")
    off = generate(path, monkeypatch, **kw)
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "0")
    assert generate(path, monkeypatch, **kw) == off


def test_fp8_kv_cache_graphs_equal_eager(model_dirs, monkeypatch):
    path, _ = model_dirs("qwen3_hd128")
    kw = dict(attn="auto", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    eager = generate(path, monkeypatch, cuda_graph_max_bs=0, **kw)
    graphs = generate(path, monkeypatch, cuda_graph_max_bs=16, graphs=True, **kw)
    assert graphs == eager


def test_fi_graph_decode_replans_only_on_new_pages(model_dirs, monkeypatch):
    """fi's CUDA-core decode plan depends on the page counts only: a graph replay whose batch
    holds the same pages as the last plan reuses it. Same tokens as eager fi (which plans every
    step), over many page boundaries (page size 4), and far fewer plans than steps."""
    flashinfer = pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3_hd128")
    plans: list[object] = []  # every wrapper.plan flashinfer runs (the backend skips some)
    for cls in (
        flashinfer.BatchDecodeWithPagedKVCacheWrapper,
        flashinfer.BatchPrefillWithPagedKVCacheWrapper,
    ):

        def counting_plan(wrapper, *args, _plan=cls.plan, **kwargs):
            plans.append(wrapper)
            return _plan(wrapper, *args, **kwargs)

        monkeypatch.setattr(cls, "plan", counting_plan)
    outs, counts = [], []
    for max_bs in (0, 8):
        llm = LLM(
            path,
            device="cuda:0",
            dtype="bfloat16",
            attn="fi",
            page_size=4,
            num_pages=256,
            cuda_graph_max_bs=max_bs,
        )
        try:
            for batch in (prompts(1), prompts(3)):  # one stream, then three
                plans.clear()
                res = llm.generate(batch, SamplingParams(max_tokens=48), use_tqdm=False)
                outs.append([o["token_ids"] for o in res])
                counts.append(len(plans))
            check_no_leak(llm.scheduler)
        finally:
            llm.shutdown()
    assert outs[:2] == outs[2:]
    # eager: a plan per step (about 48); graphs: one per new page (about 12) + the prefill
    assert counts[0] >= 48 and counts[2] <= 20, counts


def test_graph_logits_equal_eager_logits(model_dirs):
    """One decode step of 5 requests (padded to the captured size 8) through a graph and
    eagerly: the logits agree."""
    path, _ = model_dirs("llama")
    llm = LLM(path, device="cuda:0", dtype="float32", attn="triton", page_size=4, num_pages=128)
    try:
        engine, sched = llm.engine, llm.scheduler
        if engine.graphs is None:
            pytest.skip("the triton backend has no CUDA-graph support yet")
        reqs = [sched.make_request(p, SamplingParams(max_tokens=4)) for p in prompts(5)]
        for req in reqs:
            sched.planner.admit(req)
            assert sched.planner.grow(req, req.remaining_len)
            req.extend_len = req.remaining_len - 1
        from minisgl.core import Batch

        engine.forward(Batch(reqs, "prefill"))
        for req in reqs:
            req.cached_len, req.extend_len = len(req.tokens) - 1, 1
        batch = Batch(reqs, "decode")
        via_graph = engine.forward(batch).logits.float().clone()
        graphs, engine.graphs = engine.graphs, None
        eager = engine.forward(Batch(reqs, "decode")).logits.float()
        engine.graphs = graphs
        torch.testing.assert_close(via_graph, eager, atol=1e-4, rtol=1e-4)
        for req in reqs:
            sched.planner.release(req)
        check_no_leak(sched)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("attn", ["torch", "triton"])
def test_overlap_on_off_identical_on_gpu(model_dirs, monkeypatch, attn):
    path, _ = model_dirs("qwen3")
    on = generate(path, monkeypatch, overlap=True, attn=attn, dtype="float32")
    off = generate(path, monkeypatch, overlap=False, attn=attn, dtype="float32")
    assert on == off


def test_sampling_kernel_matches_torch_sampler(monkeypatch):
    from minisgl.core import Req

    vocab, batch = 151936, 64
    logits = torch.randn(batch, vocab, device="cuda") * 3
    reqs = [
        Req(
            [1] * (i + 1),
            i + 1,
            SamplingParams(temperature=[0.0, 0.6, 1.0, 1.7][i % 4], seed=i),
            999,
        )
        for i in range(batch)
    ]
    args = sampling_args(reqs, vocab, logits.device)
    fused = sample(logits, *args)
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    reference = sample(logits, *args)
    same = (fused == reference).float().mean().item()
    assert same >= 0.98, f"only {same:.1%} of rows agree"  # float rounding may split near-ties
    greedy = args[0] == 0
    assert torch.equal(fused[greedy], logits[greedy].argmax(-1))


def test_sampling_kernel_follows_softmax():
    from minisgl.core import Req

    vocab, n = 8, 4000
    logits = torch.randn(vocab, device="cuda").repeat(n, 1)
    reqs = [
        Req([1] * (i + 1), i + 1, SamplingParams(temperature=0.7, seed=3), 9999) for i in range(n)
    ]
    args = sampling_args(reqs, vocab, logits.device)
    counts = torch.bincount(sample(logits, *args), minlength=vocab).float() / n
    assert (counts - torch.softmax(logits[0] / 0.7, -1)).abs().max() < 0.03


def test_shared_prompts_radix_equals_naive_on_gpu(model_dirs, monkeypatch):
    """Prompts shared while their requests run (including equal prompts prefilled in one
    batch, whose duplicate pages are freed and reused at once, behind the launched step on the
    stream) give the same greedy tokens as the cache that shares nothing. Triton only: fi has
    neither float32 nor this tiny model's head_dim 32 (its paging is checked against torch in
    test_attention_gpu)."""
    attn = "triton"
    monkeypatch.setenv("MINISGL_DISABLE_OVERLAP_SCHEDULING", "0")
    path, _ = model_dirs("qwen3")
    rng = random.Random(3)
    groups = [[rng.randrange(2, 500) for _ in range(40)] for _ in range(4)]
    batch = [
        g + [rng.randrange(2, 500) for _ in range(i % 3 * 7)] for i in range(12) for g in groups
    ]
    outs = {}
    for cache in ("radix", "naive"):
        kwargs = dict(dtype="float32", attn=attn, page_size=4, num_pages=160)
        llm = LLM(path, device="cuda:0", cache=cache, max_prefill_tokens=96, **kwargs)
        try:
            res = llm.generate(batch, SamplingParams(max_tokens=10), use_tqdm=False)
            outs[cache] = [o["token_ids"] for o in res]
            check_no_leak(llm.scheduler)
            if cache == "radix":
                assert llm.scheduler.planner.num_cached_tokens > 0
        finally:
            llm.shutdown()
    assert outs["radix"] == outs["naive"]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # without and with the q/k norm
@pytest.mark.parametrize("attn,graphs", [("torch", False), ("triton", False), ("triton", True)])
def test_fused_rotary_kv_store_equals_torch_path(model_dirs, monkeypatch, arch, attn, graphs):
    """The attention layers' one kernel for (q/k norm,) RoPE and the K/V store gives the same
    greedy tokens in float32 as MINISGL_DISABLE_FUSED_OPS=1 (torch RoPE, the backend's store),
    eagerly and in CUDA graphs; with it the backends never store K/V themselves."""
    from minisgl.kvcache.pool import MHAKVCache

    path, _ = model_dirs(arch)
    store, stores = MHAKVCache.store, []

    def spy(self, *args):
        stores.append(args)
        store(self, *args)

    monkeypatch.setattr(MHAKVCache, "store", spy)
    kwargs = dict(attn=attn, dtype="float32", temperature=0.0, graphs=graphs)
    kwargs["cuda_graph_max_bs"] = 16 if graphs else 0
    fused = generate(path, monkeypatch, **kwargs)
    assert not stores
    monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "1")
    plain = generate(path, monkeypatch, **kwargs)
    assert stores  # the flag restores the separate store
    assert fused == plain


@pytest.mark.parametrize("attn", ["triton", "fi"])
def test_prefill_rows_equal_eager_prefill(model_dirs, monkeypatch, attn):
    """Small prefill and mixed steps replayed as decode-graph rows, one per position, give the
    eager extend's tokens (float32 triton: equal; fi in bf16: up to near ties), and ran."""
    from minisgl.ext.perf import prefill_rows

    replay_rows, rows = prefill_rows.replay_rows, []

    def counted(engine, batch, flat, samples, resample):
        rows.append(flat.size)
        return replay_rows(engine, batch, flat, samples, resample)

    monkeypatch.setattr(prefill_rows, "replay_rows", counted)
    if attn == "triton":
        path, _ = model_dirs("qwen3")
        eager = generate(path, monkeypatch, attn=attn, dtype="float32", disable_prefill_graphs=True)
        assert not rows
        assert generate(path, monkeypatch, attn=attn, dtype="float32", graphs=True) == eager
        assert rows
        return
    pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3_hd128")  # bf16, greedy (rows take no logprobs requests)
    kw: dict = {"attn": attn, "dtype": "bfloat16", "temperature": 0.0}
    eager = generate(path, monkeypatch, disable_prefill_graphs=True, **kw)
    assert not rows
    as_rows = generate(path, monkeypatch, graphs=True, **kw)
    assert rows
    # another kernel rounds differently in bf16: a near-tie may part a sequence later on
    assert sum(a == b for a, b in zip(eager, as_rows)) >= len(eager) * 3 // 4
    assert sum(a[0] == b[0] for a, b in zip(eager, as_rows)) >= len(eager) - 2


@pytest.mark.parametrize("attn", ["triton", "fi"])
def test_mixed_steps_equal_separate_steps(model_dirs, monkeypatch, attn):
    """Issue 22: decode rows computed beside prompt chunks (the prefill kernels) give the tokens
    that decode-only steps (graphs, decode kernels) give. The 24 prompts arrive at once and
    are chunked 64 tokens a step, so most steps mix."""
    kw: dict = {"disable_mixed_steps": True}
    if attn == "triton":
        path, _ = model_dirs("qwen3")
        separate = generate(path, monkeypatch, attn=attn, dtype="float32", **kw)
        mixed = generate(path, monkeypatch, attn=attn, dtype="float32", max_num_batched_tokens=80)
        assert mixed == separate
        return
    pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3_hd128")
    separate_outs = greedy_with_logprobs(path, monkeypatch, attn=attn, **kw)
    mixed_outs = greedy_with_logprobs(path, monkeypatch, attn=attn, max_num_batched_tokens=80)
    assert_equal_up_to_near_ties(separate_outs, mixed_outs)


@pytest.mark.parametrize("backoff", [16, 0])
@pytest.mark.parametrize("attn", ["triton", "fi"])
@pytest.mark.parametrize("algorithm", ["ngram", "standalone"])
def test_speculative_decoding_equals_plain_on_gpu(
    model_dirs, monkeypatch, attn, algorithm, backoff
):
    """Issue 17: verification extends (prefill kernels) and the draft's graph decode steps
    give plain decoding's tokens, greedy and sampled; adaptive (overlapped steps between
    proposals) and proposing at every step."""
    if attn == "fi":
        pytest.importorskip("flashinfer")
    path, _ = model_dirs("qwen3" if attn == "triton" else "qwen3_hd128")
    spec: dict = {"speculative_algorithm": algorithm, "speculative_num_draft_tokens": 3}
    spec["speculative_max_backoff"] = backoff
    if algorithm == "standalone":
        spec["speculative_draft_model_path"] = path  # itself: every proposal accepted
    if attn == "triton":
        plain = generate(path, monkeypatch, attn=attn, dtype="float32")
        assert generate(path, monkeypatch, attn=attn, dtype="float32", **spec) == plain
        return
    plain_outs = greedy_with_logprobs(path, monkeypatch, attn=attn)
    assert_equal_up_to_near_ties(
        plain_outs, greedy_with_logprobs(path, monkeypatch, attn=attn, **spec)
    )


@pytest.mark.parametrize("pdl", ["on", "off"])
@pytest.mark.parametrize("num_prompts", [1, 4])
def test_lora_kernels_equal_the_torch_reference(model_dirs, monkeypatch, pdl, num_prompts):
    """ext/lora's Triton kernels (PDL on and off), in CUDA-graph decode with the base model
    and two adapters in one batch, float32: the same tokens as the torch reference
    (MINISGL_DISABLE_FUSED_OPS=1); 3 rows decode through the joint GEMV of [A; W] and one
    launch after it, 12 through cuBLAS between the shrink and the expand. A LoRA
    kernel that read its input before the kernel that writes it had finished would change them."""
    import os
    import sys

    from minisgl.ext.lora import LoRARequest
    from minisgl.kernel import pdl as pdl_module

    if pdl == "on" and not pdl_module.enabled(torch.device("cuda")):
        pytest.skip("PDL needs an sm_90+ GPU")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmark", "offline"))
    from bench import write_adapters

    path, _ = model_dirs("qwen3_hd128")
    paths = write_adapters(path, 2, rank=8, b_scale=1.0)  # large enough to change tokens
    adapters = [None] + [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    monkeypatch.setenv("MINISGL_DISABLE_PDL", "0" if pdl == "on" else "1")

    def run(fused: bool) -> list[list[int]]:
        monkeypatch.setenv("MINISGL_DISABLE_FUSED_OPS", "0" if fused else "1")
        llm = LLM(path, device="cuda:0", dtype="float32", page_size=16, num_pages=256,
                  cuda_graph_max_bs=16, enable_lora=True, max_loras=2, max_lora_rank=8)  # fmt: skip
        try:
            assert llm.engine.graphs is not None
            lora = next(f for f in llm.scheduler.features if f.name == "lora")
            # the 3-row decode steps take the joint GEMV of [A; W] on every projection
            assert all(p.joint is not None for p in lora.transform.stack.projections.values())
            params = SamplingParams(max_tokens=12, temperature=0)
            each = [p for p in prompts(num_prompts) for _ in adapters]  # under all three
            requests = adapters * num_prompts
            outs = llm.generate(each, params, use_tqdm=False, lora_request=requests)
            check_no_leak(llm.scheduler)
            return [o["token_ids"] for o in outs]
        finally:
            llm.shutdown()

    fused = run(True)
    assert fused == run(False)
    assert len({tuple(t) for t in fused[:3]}) == 3  # each adapter changes the answer
