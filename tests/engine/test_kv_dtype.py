"""--kv-cache-dtype fp8_e4m3 / fp8_e5m2, on the CPU: the pool stores K and V in 8 bits and
attention widens them on load. In float32 the fp8 run must equal a float32 run whose stored
K/V are rounded through the same fp8 type (the only difference is storage), and stay close to
the plain run."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import minisgl.kvcache.pool as pool_mod
from minisgl import LLM, SamplingParams
from minisgl.attention import auto_backend, create_attention_backend
from minisgl.core import Batch
from minisgl.engine import EngineConfig
from minisgl.server.args import parse_args
from support.invariants import check_no_leak

FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def prefill_and_decode_logits(path: str, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of one prefill of 4 prompts and of one decode step on top (page size 4)."""
    llm = LLM(path, device="cpu", page_size=4, num_pages=64, **kwargs)
    sched, engine = llm.scheduler, llm.engine
    prompts = [[2 + (5 * i + 3 * j) % 90 for j in range(6 + 7 * i)] for i in range(4)]
    reqs = [sched.make_request(p, SamplingParams(max_tokens=4)) for p in prompts]
    for req in reqs:  # admitted by hand: one prefill forward of the whole batch
        sched.planner.admit(req)
        assert sched.planner.grow(req, req.remaining_len)
        req.extend_len = req.remaining_len
    prefill = engine.forward(Batch(reqs, "prefill")).logits.float()
    for req, tok in zip(reqs, prefill.argmax(-1).tolist()):
        req.cached_len, req.extend_len = len(req.tokens), 1
        req.tokens.append(tok)
        engine.set_tokens(req.table_idx, req.tokens)
        assert sched.planner.grow(req, 1)
    decode = engine.forward(Batch(reqs, "decode")).logits.float()
    for req in reqs:
        req.cached_len = len(req.tokens)
        sched.planner.release(req)
    check_no_leak(sched)
    llm.shutdown()
    return prefill, decode


@pytest.mark.parametrize("name", list(FP8))
def test_fp8_pool_equals_float32_pool_of_rounded_kv(model_dirs, monkeypatch, name):
    path, _ = model_dirs("qwen3")
    fp8 = prefill_and_decode_logits(path, kv_cache_dtype=name)
    plain = prefill_and_decode_logits(path)

    store = pool_mod.store_kv_torch

    def store_rounded(k_pool, v_pool, out_loc, k, v):
        store(k_pool, v_pool, out_loc, k.to(FP8[name]).float(), v.to(FP8[name]).float())

    monkeypatch.setattr(pool_mod, "store_kv_torch", store_rounded)
    rounded = prefill_and_decode_logits(path)
    for got, want, base in zip(fp8, rounded, plain):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        # 8-bit storage does change the logits (the test would notice a no-op), but little
        assert (got - base).abs().max() > 1e-4
        cos = torch.nn.functional.cosine_similarity(got, base, dim=-1)
        assert cos.min() > 0.99, cos


def test_fp8_pool_is_smaller_and_generates(model_dirs):
    path, _ = model_dirs("llama")
    sizes = {}
    for name in ("auto", "fp8_e4m3"):
        llm = LLM(path, device="cpu", kv_cache_dtype=name, cpu_kv_cache_mb=4)
        sizes[name] = llm.engine.kv_cache.num_pages
        if name != "auto":
            assert llm.engine.kv_cache.dtype == torch.float8_e4m3fn
            assert llm.engine.kv_cache.buffer.dtype == torch.float8_e4m3fn
            prompts = [[3, 1, 4, 1, 5, 9, 2, 6][: 2 + i] for i in range(6)]
            outs = llm.generate(prompts, SamplingParams(max_tokens=9), use_tqdm=False)
            assert all(len(o["token_ids"]) == 9 for o in outs)
            check_no_leak(llm.scheduler)
        llm.shutdown()
    # float32 model on CPU: 4 bytes -> 1 byte per value, same memory budget
    assert sizes["fp8_e4m3"] - 1 == 4 * (sizes["auto"] - 1)


def test_bad_kv_cache_dtype_is_refused(capsys):
    with pytest.raises(ValueError, match="invalid kv_cache_dtype 'int8'.*fp8_e4m3"):
        EngineConfig(model="x", kv_cache_dtype="int8")
    with pytest.raises(SystemExit) as exc:
        parse_args(["--kv-cache-dtype", "fp16"])
    assert exc.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp16'" in capsys.readouterr().err
    args = parse_args(["--model", "m", "--kv-cache-dtype", "fp8_e5m2"])
    assert args.engine.kv_cache_dtype == "fp8_e5m2"


def test_auto_attention_and_fi_with_an_fp8_pool(monkeypatch):
    import minisgl.attention as attn

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(attn, "flashinfer_available", lambda: True)
    assert auto_backend(cuda, torch.bfloat16, None) == "triton"
    assert auto_backend(cuda, torch.float8_e4m3fn, None) == "triton"
    assert auto_backend(cuda, torch.bfloat16, 4096) == "fi"  # sliding window
    assert auto_backend(cuda, torch.float8_e4m3fn, 4096) == "torch"
    # the pool's dtype, not the model's, decides
    backend = create_attention_backend("auto", cuda, 4096, torch.bfloat16, 8, torch.float8_e4m3fn)
    assert backend.name == "torch"
    for name in ("fi", "fi,triton", "triton,fi"):
        with pytest.raises(ValueError, match="needs a 16-bit KV cache.*--attn triton"):
            create_attention_backend(
                name, cuda, dtype=torch.bfloat16, num_qo_heads=8, kv_dtype=torch.float8_e5m2
            )


@pytest.mark.ext
def test_auto_prefill_is_fi_on_hopper_only(monkeypatch):
    """--attn auto's prefill: fi (FA3) on a Hopper GPU with flashinfer, a 16-bit KV cache and
    ext/perf's pair; triton's otherwise (the decode's)."""
    import minisgl.attention as attn
    from minisgl.ext.perf.hybrid import hopper_prefill
    from minisgl.extension import extensions

    cuda = torch.device("cuda", 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(attn, "flashinfer_available", lambda: True)
    assert extensions().auto_prefill(cuda, torch.bfloat16) == "fi"  # the point is ext/perf's
    assert hopper_prefill(cuda, torch.float8_e4m3fn) == "triton"  # fi reads 16-bit KV only
    capability[0] = (8, 0)
    assert hopper_prefill(cuda, torch.bfloat16) == "triton"  # FA3 is Hopper's
    capability[0] = (9, 0)
    monkeypatch.setattr(attn, "flashinfer_available", lambda: False)
    assert hopper_prefill(cuda, None) == "triton"
    monkeypatch.setattr(attn, "flashinfer_available", lambda: True)
    monkeypatch.setattr(extensions(), "auto_prefill", None)  # the core alone: no pair
    if importlib.util.find_spec("triton") is not None:
        assert create_attention_backend("auto", cuda, dtype=torch.bfloat16).name == "triton"
