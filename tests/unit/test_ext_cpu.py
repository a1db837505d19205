"""The cpu extension (`minisgl/ext/cpu`) and the core without it (issue 46): with
MINISGL_DISABLE_EXTENSIONS=1 a GGUF model, the embedded default model (a GGUF),
`--quantization gguf|int8` and `--enable-torch-compile` are refused, offline and on the command
line, saying that they need the cpu extension; a dense safetensors model loads and generates
the same tokens as with the extension (transformers' greedy tokens, in float32)."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import fields, replace
from types import SimpleNamespace

import pytest
import torch

from minisgl import LLM, SamplingParams, extension
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.context import Context, get_global_ctx, set_global_ctx
from minisgl.engine.config import EngineConfig
from minisgl.extension import ExtensionMissing, Extensions
from minisgl.kvcache.pool import MHAKVCache
from minisgl.layers.attention import AttentionLayer
from minisgl.layers.rotary import RopeConfig, RotaryEmbedding
from minisgl.models.weight import default_model, resolve_model_path
from minisgl.utils.options import OptionError
from support.attn import make_problem
from support.invariants import check_no_leak
from support.models import hf_greedy

NEEDS = "needs the cpu extension (minisgl/ext/cpu)"


def test_the_extension_fills_its_points() -> None:
    points = extension.extensions()
    assert points.gguf_model is not None and points.default_model is not None
    from minisgl.ext.cpu.options import engine_options  # (also --dtype auto's choice)

    assert engine_options in points.engine_config and points.model_transform is not None
    assert points.decoder_transform is not None


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"quantization": "int8"}, "quantization"),
        ({"quantization": "gguf"}, "quantization"),
        ({"quantization": "none"}, "quantization"),  # the option is the extension's
        ({"enable_torch_compile": True}, "enable_torch_compile"),
    ],
)
def test_options_of_the_extension_are_refused(core_alone, options, name) -> None:
    with pytest.raises(ExtensionMissing) as info:
        LLM.configs("model", options)  # what LLM(...) does with its keywords
    assert (info.value.what, info.value.extension) == (name, "cpu")
    assert str(info.value) == f"{name} {NEEDS}"
    assert not any(f.name == name for f in fields(EngineConfig))


@pytest.mark.ext
def test_the_extension_hands_its_options_to_the_engine() -> None:
    from minisgl.ext.cpu.options import CpuOptions, cpu_options

    engine, sched = LLM.configs("model", {"quantization": "int8", "enable_torch_compile": True})
    assert sched.extras["cpu"] == CpuOptions("int8", True)
    for adjust in extension.extensions().engine_config:
        engine = adjust(engine, sched)
    assert cpu_options(engine) == CpuOptions("int8", True)
    with pytest.raises(OptionError, match="invalid quantization 'int4'") as info:
        LLM.configs("model", {"quantization": "int4"})
    assert info.value.name == "quantization"


@pytest.mark.ext
def test_dtype_auto_on_cpu_is_the_extensions_choice(monkeypatch) -> None:
    """--dtype auto on cpu: bfloat16 for quantized weights on a bf16 CPU (`engine_options`,
    which the core's float32 then never sees), float32 under MINISGL_CPU_FLOAT32=1."""
    from minisgl.ext.cpu import policy
    from minisgl.ext.cpu.options import engine_options

    engine, sched = LLM.configs("model", {"quantization": "int8", "device": "cpu"})
    monkeypatch.setattr(policy, "cpu_bf16_flag", lambda: "avx512_bf16")
    assert engine_options(engine, sched).dtype == "float32"  # conftest: MINISGL_CPU_FLOAT32
    monkeypatch.setenv("MINISGL_CPU_FLOAT32", "0")
    assert engine_options(engine, sched).dtype == "bfloat16"
    given = replace(engine, dtype="float16")
    assert engine_options(given, sched).dtype == "float16"


def test_gguf_and_default_models_are_refused(core_alone, tmp_path) -> None:
    path = str(tmp_path / "tiny.gguf")  # refused before it is looked at
    with pytest.raises(OptionError) as info:
        resolve_model_path(path, "speculative_draft_model_path")
    assert info.value.name == "speculative_draft_model_path"
    assert str(info.value) == f"the GGUF model {path!r} {NEEDS}"
    with pytest.raises(ValueError, match=re.escape(f"tiny.gguf' {NEEDS}")):
        LLM(path)
    with pytest.raises(ExtensionMissing, match="^no --model: the embedded default model .* needs"):
        default_model()
    with pytest.raises(ExtensionMissing) as missing:
        LLM()
    assert missing.value.extension == "cpu"


def cli(*flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, MINISGL_DISABLE_EXTENSIONS="1")
    argv = [sys.executable, "-m", "minisgl", "--device", "cpu", "--shell", *flags]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        ([], "python -m minisgl: no --model: the embedded default model"),
        (
            ["--model", "tiny.gguf"],
            f"minisgl: argument --model: the GGUF model 'tiny.gguf' {NEEDS}",
        ),
        (
            ["--model", ".", "--quantization", "int8"],
            f"python -m minisgl: error: --quantization {NEEDS}",
        ),
        (
            ["--model", ".", "--enable-torch-compile"],
            f"python -m minisgl: error: --enable-torch-compile {NEEDS}",
        ),
    ],
)
def test_command_line_refusals(flags, says) -> None:
    done = cli(*flags)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    line = done.stderr.strip().splitlines()[-1]
    assert line.startswith(says) and line.endswith(NEEDS), line


def generate(path: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(path, page_size=4, num_pages=64)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8]]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    return llm, [out["token_ids"] for out in llm.generate(prompts, params, use_tqdm=False)]


def test_dense_model_generates_as_with_the_extension(model_dirs, monkeypatch) -> None:
    path, hf = model_dirs("llama")
    with_ext, want = generate(path)
    assert want == [hf_greedy(hf, [3, 1, 4, 1, 5, 9, 2, 6], 10), hf_greedy(hf, [2, 7, 1, 8], 10)]
    assert with_ext.engine.model_transform is not None  # the extension took part
    assert speed_paths(with_ext) == ("TableRotary", "WideTorchAttnBackend")
    monkeypatch.setenv("MINISGL_DISABLE_EXTENSIONS", "1")
    monkeypatch.setattr(extension, "_EXTENSIONS", Extensions())
    alone, got = generate(path)
    assert got == want
    assert alone.engine.model_transform is None and alone.engine.quantization == "none"
    assert not any(hasattr(m, "quantized") for m in alone.engine.model.modules())
    assert speed_paths(alone) == ("RotaryEmbedding", "TorchAttnBackend")  # the plain paths
    check_no_leak(alone.scheduler)


def speed_paths(llm: LLM) -> tuple[str, str]:
    """The classes of the engine's rotary (the one every attention layer holds) and backend."""
    engine = llm.engine
    rotary = engine.model.model.rotary
    layers = [m for m in engine.model.modules() if isinstance(m, AttentionLayer)]
    assert layers and all(layer.rotary[0] is rotary for layer in layers)
    assert engine.ctx.attn_backend is engine.attn_backend
    return type(rotary).__name__, type(engine.attn_backend).__name__


@pytest.mark.ext
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_table_rotary_equals_the_plain_path(dtype) -> None:
    """ext/cpu's RoPE rotates q and k as one view when k follows q in the QKV output and
    reuses one forward's rows across layers: both bit for bit the core's plain path, and a
    new forward (a new positions tensor) looks the rows up again."""
    from minisgl.ext.cpu.speed import TableRotary, adjacent

    cfg = RopeConfig(head_dim=64, max_position=512)
    plain, rope = RotaryEmbedding(cfg), TableRotary(cfg, torch.float32)  # bf16: a new table
    gen = torch.Generator().manual_seed(21)
    qkv = torch.randn(5, (4 + 2 + 2) * 64, generator=gen).to(dtype)
    cases = [torch.tensor([0, 3, 9, 100, 511]), torch.tensor([7, 8, 9, 10, 11]), torch.tensor([4])]
    for positions in cases:  # the last: one token (decode), whose row stride is arbitrary
        rows = qkv[: len(positions)]
        q, k, _ = (t.unflatten(-1, (-1, 64)) for t in rows.split([256, 128, 128], -1))
        assert adjacent(q, k) is not None
        want = plain(positions, q.clone(), k.clone())
        for _ in range(2):  # the second call reuses the rows
            got = rope(positions, q, k)
            assert all(torch.equal(g, w) for g, w in zip(got, want))
        apart = rope(positions, q.clone(), k.clone())  # not adjacent: rotated one by one
        assert all(torch.equal(g, w) for g, w in zip(apart, want))


@pytest.mark.ext
@pytest.mark.parametrize("decode", [True, False])
def test_wide_attention_equals_the_plain_path_in_float32(decode) -> None:
    """ext/cpu's torch backend attends a 16-bit model in float32: bit for bit the core's
    backend on the widened q and pool, rounded once at the end."""
    from minisgl.ext.cpu.speed import WideTorchAttnBackend

    lens = [(5, 1), (9, 1), (3, 1)] if decode else [(0, 7), (6, 3)]
    cpu = torch.device("cpu")
    batch, q, _, _ = make_problem(lens, 4, 16, torch.bfloat16, decode, cpu)
    wide = WideTorchAttnBackend()
    wide.prepare(batch)
    got = wide.forward(q, 0, 0.25, batch)
    ctx = get_global_ctx()
    _, layers, pages, page_size, heads, dim = ctx.kv_cache.buffer.shape
    widened = MHAKVCache(layers, pages, page_size, heads, dim, torch.float32, cpu)
    widened.buffer.copy_(ctx.kv_cache.buffer)  # the same KV, widened
    set_global_ctx(Context(page_size, ctx.page_table, widened, ctx.attn_backend))
    want = TorchAttnBackend().forward(q.float(), 0, 0.25, batch).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)


@pytest.mark.ext
@pytest.mark.parametrize(
    "lens, window, dtype",
    [
        ([(0, 9)], None, torch.float32),
        ([(0, 7), (0, 3), (0, 5)], None, torch.float32),
        ([(0, 7), (0, 3)], 16, torch.bfloat16),
        ([(0, 8)], 4, torch.float32),  # a window shorter than the prompt: the mask
        ([(0, 5), (2, 3)], None, torch.float32),  # a cached prefix: the mask
    ],
)
def test_fresh_prompts_attend_causally_bit_for_bit(lens, window, dtype) -> None:
    """ext/cpu attends prompts without a cached prefix with SDPA's is_causal instead of the
    core's mask (padded rows dropped): the same bits as the core's masked path."""
    from minisgl.ext.cpu.speed import PromptMetadata, WideTorchAttnBackend

    batch, q, _, _ = make_problem(lens, 4, 16, dtype, False, torch.device("cpu"))
    wide = WideTorchAttnBackend(window)
    wide.prepare(batch)
    causal = all(c == 0 for c, _ in lens) and (window is None or window >= max(e for _, e in lens))
    md = batch.attn_metadata
    assert (isinstance(md, PromptMetadata) and md.fresh) == causal
    got = wide.forward(q, 0, 0.25, batch)
    plain = TorchAttnBackend(window)
    plain.prepare(batch)
    want = plain.forward(q.float(), 0, 0.25, batch).to(dtype)
    assert got.shape == q.shape and torch.equal(got, want)


def test_pack_rule_by_vendor_and_rows() -> None:
    """oneDNN's packed weight takes every float32 row (prompts too) on a CPU naming a vendor
    other than Intel; on Intel, and on one naming none, decode steps of 4..256 rows alone."""
    from minisgl.ext.cpu.packed import rule_for

    for vendor in ("AuthenticAMD", "HygonGenuine"):
        rule = rule_for(vendor)
        assert all(rule.takes(rows, decode) for rows in (1, 2, 3, 256, 100_000)
                   for decode in (True, False))  # fmt: skip
    for vendor in ("GenuineIntel", ""):
        rule = rule_for(vendor)
        assert [rows for rows in range(1, 300) if rule.takes(rows, True)] == list(range(4, 257))
        assert not any(rule.takes(rows, False) for rows in (1, 4, 8, 256, 1000))


@pytest.fixture(params=["GenuineIntel", "AuthenticAMD"])
def vendor(request, monkeypatch) -> Iterator[str]:
    """The CPU vendor `packed.pack_rule` reads, whatever this machine's."""
    from minisgl.ext.cpu import packed

    monkeypatch.setattr(packed, "cpu_vendor", lambda: request.param)
    packed.pack_rule.cache_clear()
    yield request.param
    packed.pack_rule.cache_clear()


@pytest.mark.ext
def test_float32_projections_take_packed_weights_by_rule(model_dirs, vendor, monkeypatch) -> None:
    """ext/cpu routes a float32 model's projections through `PackedFloatLinear`. On Intel,
    decode steps of 4..256 rows compute on oneDNN's packed weight and one request's decode and
    every prompt keep F.linear, bit for bit; elsewhere every row takes oneDNN. Either way the
    packed sums are F.linear's within float32 rounding and greedy tokens transformers'."""
    from minisgl.ext.cpu import packed
    from minisgl.ext.cpu.packed import PACKED_ATTR, PackedFloatLinear, packs_available, rule_for
    from minisgl.ext.cpu.routes import projections

    if not packs_available():
        pytest.skip("this torch build has no oneDNN")
    onednn = packed.onednn_linear
    path, hf = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=128)
    routed = {name: routes_of(m) for name, m in projections(llm.engine.model)}
    assert routed and all(isinstance(p, PackedFloatLinear) for p in routed.values())
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3], [5, 7, 7, 2, 1]]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    want = [hf_greedy(hf, p, 8) for p in prompts]
    one = llm.generate(prompts[:1], params, use_tqdm=False)  # one request: packs elsewhere
    every_row = vendor != "GenuineIntel"
    assert all(hasattr(p.module.weight, PACKED_ATTR) == every_row for p in routed.values())
    assert one[0]["token_ids"] == want[0]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert len(prompts) >= rule_for("GenuineIntel").min_rows
    assert all(hasattr(p.module.weight, PACKED_ATTR) for p in routed.values())
    assert [o["token_ids"] for o in outs] == want
    check_no_leak(llm.scheduler)

    layer = routed["model.layers.0.mlp.gate_up_proj"]
    assert isinstance(layer, PackedFloatLinear)
    weight = layer.module.weight
    x = torch.randn(300, weight.shape[1])
    calls: list[int] = []
    monkeypatch.setattr(packed, "onednn_linear", lambda x, w, b: calls.append(1) or onednn(x, w, b))
    for decode, rows, on_intel in [
        (None, 8, False),  # outside a step: F.linear everywhere
        (False, 8, False),  # a prompt
        (False, 300, False),
        (True, 1, False),
        (True, 3, False),
        (True, 257, False),
        (True, 4, True),
        (True, 256, True),
    ]:
        batch = None if decode is None else SimpleNamespace(is_decode=decode)
        set_global_ctx(replace(llm.engine.ctx, batch=batch))
        calls.clear()
        got, exact = layer.forward(x[:rows]), torch.nn.functional.linear(x[:rows], weight)
        packed_here = on_intel or (every_row and batch is not None)
        assert len(calls) == packed_here
        assert (
            torch.equal(got, exact) if not packed_here else torch.allclose(got, exact, 1e-4, 1e-5)
        )
    set_global_ctx(llm.engine.ctx)


@pytest.mark.ext
def test_long_prompts_gate_and_up_on_packed_halves(model_dirs, vendor, monkeypatch) -> None:
    """A prompt whose gate/up product reaches GATED_MIN_BYTES computes silu(x Wg) * (x Wu) in
    two oneDNN GEMMs on packed halves where the rule takes prompts (not on Intel): within
    float32 rounding of F.linear and SiLU-and-mul, greedy tokens still transformers'. One
    row, a shorter product and a step-less call keep the merged product."""
    from minisgl.ext.cpu import fused, native, packed

    if not packed.packs_available() or not native.float32_kernels():
        pytest.skip("needs oneDNN and minisgl's float32 kernels")
    path, hf = model_dirs("llama")
    llm = LLM(path, page_size=4, num_pages=128)
    mlp = llm.engine.model.model.layers[0].mlp
    assert type(mlp) is fused.FusedMLP
    gate_up = mlp.gate_up_proj
    threshold = 12 * gate_up.weight.shape[0] * 4  # a 12-row product takes it
    monkeypatch.setattr(packed, "GATED_MIN_BYTES", threshold)
    calls: list[int] = []
    gated = packed.gated_silu
    monkeypatch.setattr(fused, "gated_silu", lambda m, x: calls.append(1) or gated(m, x))
    prompt = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == hf_greedy(
        hf, prompt, 6
    )
    assert calls and hasattr(gate_up.weight, packed.GATED_ATTR) == (vendor != "GenuineIntel")
    check_no_leak(llm.scheduler)

    x = torch.randn(16, gate_up.weight.shape[1])
    want = torch.ops.minisgl.silu_and_mul(torch.nn.functional.linear(x, gate_up.weight))
    for decode, rows, takes in [(False, 16, True), (False, 11, False), (True, 1, False)]:
        set_global_ctx(replace(llm.engine.ctx, batch=SimpleNamespace(is_decode=decode)))
        got = packed.gated_silu(gate_up, x[:rows])
        assert (got is not None) == (takes and vendor != "GenuineIntel")
        assert got is None or torch.allclose(got, want[:rows], 1e-4, 1e-5)
    set_global_ctx(replace(llm.engine.ctx, batch=None))
    assert packed.gated_silu(gate_up, x) is None
    set_global_ctx(replace(llm.engine.ctx, batch=SimpleNamespace(is_decode=False)))
    route = gate_up.forward
    monkeypatch.setattr(gate_up, "forward", lambda x: route(x))  # wrapped by another layer
    assert packed.gated_silu(gate_up, x) is None
    set_global_ctx(llm.engine.ctx)


def routes_of(module: torch.nn.Module) -> object:
    """The object whose bound method the cpu extension installed as the projection's route
    (the LM head's route is a closure over it)."""
    route = vars(module).get("matmul") or vars(module)["forward"]
    if hasattr(route, "__self__"):
        return route.__self__
    cells = [c.cell_contents for c in route.__closure__ or ()]
    return next(c.__self__ for c in cells if hasattr(c, "__self__"))


HEAP_STEPS = """
import resource, sys, torch
torch.set_num_threads(1)
from minisgl.ext.cpu.heap import keep_freed_memory
kept = sys.argv[1] == "keep" and keep_freed_memory()
def faults(rounds):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(rounds):
        for mib in (1, 3, 6, 12, 24):  # blocks freed layer after layer, as a step's activations
            blocks = [torch.ones(mib << 18) for _ in range(3)]
            del blocks
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults(1)
print(kept, faults(4))
"""


@pytest.mark.ext
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc settings")
def test_a_cpu_engines_process_keeps_the_memory_its_steps_free(model_dirs) -> None:
    """Blocks freed round after round, as a step's activations: by default glibc gives the
    heap's top back to the kernel and faults its pages in again each round (a 1,000-token
    prompt of SmolLM2: 31,000-134,000 faults); once the process keeps freed memory
    (`heap.keep_freed_memory`, which a cpu engine's start calls) none. Fresh processes: the
    settings hold for the rest of a process."""
    from minisgl.ext.cpu import heap

    def run(mode: str) -> tuple[bool, int]:
        argv = [sys.executable, "-c", HEAP_STEPS, mode]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True)
        kept, faults = out.stdout.split()
        return kept == "True", int(faults)

    kept, faults = run("keep")
    # (one 2 MiB region, 512 faults, was seen under a neighbour's memory pressure: not the
    # tens of thousands a round this guards against)
    assert kept and faults < 1_000
    assert run("default")[1] > 10_000
    heap.keep_freed_memory.cache_clear()
    LLM(model_dirs("llama")[0], page_size=4, num_pages=16, cpu_compile="off")
    assert heap.keep_freed_memory.cache_info().currsize == 1
