"""minisgl's own CPU kernel (ext/cpu/native.py, qdot.cpp) and its layer `VnniLinear`: the GGUF's
codes and scales kept exactly, the kernel equal to a torch model of its arithmetic (int8
activation codes per block of 32, integer dot products), its error within what those codes
allow, the same bits whatever the threads and the batch, the compiled op, and the fallbacks
(switched off, no compiler)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import gguf
import pytest
import torch

from engine.test_quantized import gguf_blocks, on_one_thread_and_two
from minisgl.ext.cpu import native
from minisgl.ext.cpu.gguf_quant import Blocks
from minisgl.ext.cpu.native import cpu_flags
from minisgl.ext.cpu.quantize import from_blocks, prune_packed, vnni_from_blocks
from minisgl.ext.cpu.quantized import Int4Linear, VnniLinear
from minisgl.extension import extensions

Q = gguf.GGMLQuantizationType
pytestmark = pytest.mark.skipif(
    native.native_kernel() is None, reason="needs AVX512-VNNI and a C++ compiler"
)
KINDS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0]


def layer_of(
    qtype: Q, rows: int = 48, cols: int = 96, seed: int = 0
) -> tuple[VnniLinear, torch.Tensor]:
    blocks, ref = gguf_blocks(qtype, rows=rows, cols=cols, seed=seed)
    layer = from_blocks([blocks], torch.bfloat16)
    bits = 4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 6 if qtype == Q.Q6_K else 8
    assert isinstance(layer, VnniLinear) and layer.bits == bits and layer.halves == (bits == 6)
    return layer, torch.from_numpy(ref)


def q4_k_m_layer(rows: int = 64, cols: int = 512, seed: int = 0) -> tuple[VnniLinear, torch.Tensor]:
    """A q/k/v as Q4_K_M files have it in some layers: Q4_K q and k, a Q6_K v (six-bit codes, a
    d per 16 weights for all three)."""
    parts = [
        gguf_blocks(q, rows=rows // 4 * n, cols=cols, seed=seed + n)
        for n, q in ((2, Q.Q4_K), (1, Q.Q4_K), (1, Q.Q6_K))
    ]
    layer = from_blocks([p[0] for p in parts], torch.bfloat16)
    assert isinstance(layer, VnniLinear) and layer.bits == 6 and layer.halves
    return layer, torch.cat([torch.from_numpy(p[1]) for p in parts])


def activations(rows: int, cols: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    x[0, :32] = 0  # a block of zeros: dx = 0
    return x.to(dtype)


def int8_model(x: torch.Tensor, layer: VnniLinear) -> torch.Tensor:
    """qdot.cpp's arithmetic in torch (float64 sums): per row and block, dx = max |x| / 127 and
    xq = round(x * 127 / max |x|) (float32, to nearest even); y = sum over blocks of
    d dx sum(c xq) + mn sum(x), c the codes less the eight-bit offset."""
    xf = x.float().unflatten(1, (-1, 32))
    amax = xf.abs().amax(-1, keepdim=True)
    # a true division (127 / tensor is 127 * its reciprocal: another rounding)
    inv = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    xq = torch.round(xf * inv)
    dx = (amax / 127).squeeze(-1).double()
    rows, blocks, groups = layer.out_features, layer.in_features // 32, 1 + layer.halves
    codes = layer.unpacked_codes().unflatten(1, (blocks, groups, 32 // groups)).double()
    codes = codes - layer.offset
    d, mn = (t.double() for t in layer.block_scales())
    d = d.view(rows, blocks, groups)  # a d for each half with halves
    dots = torch.einsum("mghk,nghk->mngh", xq.unflatten(-1, (groups, -1)).double(), codes)
    sums = xf.double().sum(-1)
    scaled = (d[None] * dx[:, None, :, None] * dots).sum(-1)
    return (scaled + mn[None] * sums[:, None]).sum(-1)


@pytest.mark.parametrize("qtype", KINDS)
def test_keeps_the_gguf_codes_and_scales(qtype):
    """The layout round-trips: dequantized, the layer is the gguf package's floats bit for bit."""
    layer, ref = layer_of(qtype)
    assert torch.equal(layer.dequantize(), ref)


def test_merges_parts_of_every_kind():
    """q/k/v of different kinds in one layer: eight-bit codes, rows concatenated in order; only
    4-bit parts: four-bit codes; beside Q6_K: six-bit codes, the others' weights exact."""
    kinds = [Q.Q8_0, Q.Q4_0, Q.Q4_1]
    parts = [gguf_blocks(q, rows=16, seed=i) for i, q in enumerate(kinds)]
    layer = vnni_from_blocks([p[0] for p in parts], four_bit=False)
    assert layer is not None and layer.bits == 8 and layer.out_features == 48
    kinds = [Q.Q4_0, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K, Q.Q6_K]
    six = [gguf_blocks(q, rows=16, cols=256, seed=i) for i, q in enumerate(kinds)]
    merged = from_blocks([p[0] for p in six], torch.bfloat16)
    assert isinstance(merged, VnniLinear) and merged.bits == 6 and not merged.k_layout
    rounded = [  # beside other kinds, the K-quants' d sc and mn rounded once to float16
        Blocks(b.kind, b.codes, b.scales.half().float(), b.mins.half().float())
        if b.k is not None and b.mins is not None
        else b
        for b, _ in six[:-1]
    ]
    assert torch.equal(merged.dequantize()[:-16], torch.cat([b.dequantize() for b in rounded]))
    k_only = from_blocks([p[0] for p in six[3:]], torch.bfloat16)  # Q4_K, Q5_K, Q6_K: exact
    assert isinstance(k_only, VnniLinear) and k_only.bits == 6 and k_only.k_layout
    assert torch.equal(k_only.dequantize(), torch.cat([torch.from_numpy(p[1]) for p in six[3:]]))
    assert torch.equal(layer.dequantize(), torch.cat([torch.from_numpy(p[1]) for p in parts]))
    four = from_blocks([p[0] for p in parts[1:]], torch.bfloat16)
    assert isinstance(four, VnniLinear) and four.bits == 4
    assert torch.equal(four.dequantize(), torch.cat([torch.from_numpy(p[1]) for p in parts[1:]]))


@pytest.mark.parametrize(
    "qtype, rows",
    [("Q6_K+Q8_0", 2), (Q.Q8_0, 1), (Q.Q5_0, 1), (Q.Q5_1, 2), (Q.Q4_0, 1), (Q.Q4_1, 2)],
)
def test_codes_without_minimums_go_without_the_mn_row(qtype, rows):
    """Codes whose mn are all 0 (Q6_K beside Q5_0, Q8_0, Q5_0) or -8 d at four bits (Q4_0: w =
    d (q - 8)) keep no mn row; six- and eight-bit ones give the bits they give with a row of
    zeros; those with minimums keep it. Scales of another row count are refused."""
    if qtype == "Q6_K+Q8_0":  # float16 rows: six bits beside a kind that is no K-quant
        parts = [gguf_blocks(q, rows=32, cols=512, seed=i) for i, q in enumerate([Q.Q5_0, Q.Q6_K])]
        layer = from_blocks([p[0] for p in parts], torch.bfloat16)
        assert isinstance(layer, VnniLinear) and layer.halves and not layer.k_layout
        w = torch.cat([torch.from_numpy(p[1]) for p in parts])
    else:
        layer, w = layer_of(qtype, rows=64, cols=512)
    assert layer.scales.shape[2] == rows and layer.has_min == (rows > 1 + layer.halves)
    assert torch.equal(layer.dequantize(), w) or qtype == "Q6_K+Q8_0"  # (d sc float16)
    if not layer.has_min and layer.bits != 4:
        zeros = torch.zeros_like(layer.scales[:, :, :1])
        with_row = VnniLinear(layer.codes, torch.cat([layer.scales, zeros], 2).contiguous())
        assert with_row.has_min and torch.equal(with_row.dequantize(), layer.dequantize())
        for dtype in (torch.bfloat16, torch.float16):
            for n in (1, 5, 13):
                x = activations(n, 512, dtype, seed=n)
                assert torch.equal(layer(x), with_row(x))
    if qtype == Q.Q4_0:
        x = activations(1, 512, torch.bfloat16)
        three = layer.scales.repeat(1, 1, 3, 1)
        with pytest.raises(RuntimeError, match="scales must be"):
            torch.ops.minisgl.qdot_mm(x, layer.codes, three)


@pytest.mark.parametrize(
    "args, variants",
    [
        (["--kind", "Q6_K", "--fp16-rows"], ("without mn: 0.03 MB a layer", "with mn: 0.03 MB")),
        (["--kind", "Q4_K"], ("K-quant factors: 0.02 MB a layer", "float16 rows: 0.02 MB")),
    ],
)
def test_qdot_bench_runs(args, variants):
    """benchmark/kernels/qdot_bench.py times both variants of a small layer (and checks that a
    row of zeros gives the same bits)."""
    bench = os.path.join(os.path.dirname(__file__), "..", "..", "benchmark", "kernels")
    command = [sys.executable, os.path.join(bench, "qdot_bench.py"), *args, "--out", "64",
               "--cols", "512", "--layers", "1", "--rounds", "2"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, check=True).stdout
    assert all(v in out for v in variants), out


K_QUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K, "Q4_K_M"]


def k_layer(qtype: Q | str, rows: int = 64, seed: int = 0) -> tuple[VnniLinear, torch.Tensor]:
    if qtype == "Q4_K_M":
        return q4_k_m_layer(rows=rows, seed=seed)
    return layer_of(qtype, rows=rows, cols=512, seed=seed)


@pytest.mark.parametrize("qtype", K_QUANTS)
def test_k_quants_keep_their_factors(qtype):
    """K-quants (alone or merged) keep the file's float16 d and int8 sc (and -dmin, m) per 256
    and 32 weights: the gguf package's weights bit for bit (d sc exact in float32), in 5/8 of a
    bit a weight with minimums (Q4_K 4.625 bits, Q5_K in eight), 9/16 without (Q6_K 6.5625); a
    q/k/v with a Q6_K v takes six bits and both. Scales of another size are refused."""
    layer, w = k_layer(qtype)
    bits, has_min = {Q.Q4_K: (4, True), Q.Q5_K: (8, True), Q.Q6_K: (6, False)}.get(qtype, (6, True))
    assert layer.k_layout and layer.bits == bits and layer.has_min == has_min
    assert torch.equal(layer.dequantize(), w)
    scale_bits = layer.scales.numel() * 8 / (layer.out_features * layer.in_features)
    assert scale_bits == {Q.Q6_K: 9 / 16, "Q4_K_M": 7 / 8}.get(qtype, 5 / 8)
    x = activations(1, 512, torch.bfloat16)
    with pytest.raises(RuntimeError, match="K-quants' scales must be"):
        torch.ops.minisgl.qdot_mm(x, layer.codes, layer.scales[..., :-16].contiguous())
    blocks, _ = gguf_blocks(Q.Q6_K, rows=32, cols=512)
    assert from_blocks([gguf_blocks(Q.Q8_0, rows=16, cols=512)[0], blocks], torch.bfloat16) is None


@pytest.mark.parametrize("qtype", [*KINDS, *K_QUANTS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_kernel_is_its_int8_arithmetic(qtype, dtype, rows):
    """Against the torch model of its arithmetic: within the output's rounding; and against the
    float matmul of the weights: within half an activation code per element."""
    cols = 128 if qtype in KINDS else 512
    if qtype in KINDS:
        layer, _ = layer_of(qtype, rows=64, cols=cols, seed=rows)
    else:
        layer, _ = k_layer(qtype, seed=rows)
    w = layer.dequantize()  # the weights it holds
    x = activations(rows, cols, dtype, seed=rows)
    y = layer(x)
    assert y.dtype == dtype and y.shape == (rows, layer.out_features)
    model = int8_model(x, layer)
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    assert ((y.double() - model).abs() <= eps * model.abs() + 1e-6).all()
    xf = x.float().unflatten(1, (-1, 32))
    half_code = (xf.abs().amax(-1) / 127 / 2).repeat_interleave(32, 1)  # [rows, in]
    bound = half_code @ w.abs().t() + eps * (x.float().abs() @ w.abs().t()) + 1e-6
    assert ((y.float() - x.float() @ w.t()).abs() <= bound).all()


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_same_bits_on_any_threads_and_in_any_batch(qtype):
    """Each output tile is one thread's, in a fixed order: one thread or two give the same bits,
    and a row's output does not depend on the rows beside it (8 rows pass together)."""
    layer, _ = layer_of(qtype, rows=1536, cols=576)  # SmolLM2's gate/up shape
    x = activations(11, 576, torch.bfloat16)
    outs = on_one_thread_and_two(layer, x)
    assert torch.equal(outs[0], outs[1])
    alone = torch.cat([layer(x[i : i + 1]) for i in range(11)])
    assert torch.equal(alone, outs[0])


def test_compiled_steps_call_the_op():
    """Under compilation the layer goes through torch.ops.minisgl.qdot_mm: the same bits."""
    layer, _ = layer_of(Q.Q4_1)
    x = activations(5, 96, torch.bfloat16)

    def step(h: torch.Tensor) -> torch.Tensor:
        return layer.kernel_matmul((h.float() * 0.5).to(torch.bfloat16))

    compiled = torch.compile(step, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(x), step(x))
    assert torch.equal(torch.ops.minisgl.qdot_mm(x, layer.codes, layer.scales), layer(x))


AVX2_RUN = """
import os, sys, torch
from minisgl.ext.cpu import fused, native
assert native.wanted() == os.environ["MINISGL_CPU_ISA"] and native.native_kernel() is not None
assert not native.float32_kernels() and not fused.fused_ready(torch.zeros(2))
cases = torch.load(sys.argv[1])
outs = []
for threads in (1, 2):
    torch.set_num_threads(threads)
    outs.append([torch.ops.minisgl.qdot_mm(*case) for case in cases])
torch.save(outs, sys.argv[2])
"""


@pytest.mark.parametrize("isa", ["avxvnni", "avx2"])
def test_the_256_bit_builds_give_the_same_bits(isa, tmp_path):
    """The AVX-VNNI and AVX2 builds (CPUs without AVX512; MINISGL_CPU_ISA chooses one here), each
    in a process of its own: qdot_mm's outputs equal this AVX512 build's bit for bit, four- and
    eight-bit (a Q4_K_M q/k/v too: a d per 16 weights; the K-quants' scales), bf16 and fp16, 1
    to 13 rows (4 a pass there, 8 here), with and without an mn row, on one thread and two; no
    float32 op is registered, so the float32 paths keep torch's."""
    if not set(native.ISAS[isa].needs) <= cpu_flags():
        pytest.skip(f"this CPU lacks {isa}")
    cases = []
    kinds = (Q.Q4_1, Q.Q4_0, Q.Q8_0, Q.Q5_1)  # four- and eight-bit with and without mn
    layers = [layer_of(q, rows=64, cols=576, seed=int(q))[0] for q in kinds]
    layers += [k_layer(q)[0] for q in K_QUANTS]  # the K-quants' scales, four to eight bits
    six = [gguf_blocks(q, rows=32, cols=512, seed=i)[0] for i, q in enumerate([Q.Q5_1, Q.Q6_K])]
    layers.append(from_blocks(six, torch.bfloat16))  # float16 rows at six bits
    for layer in layers:
        for dtype in (torch.bfloat16, torch.float16):
            for rows in (1, 3, 5, 8, 13):
                # large sums of codes too
                x = activations(rows, layer.in_features, dtype, seed=rows) * 4
                cases.append((x, layer.codes, layer.scales))
    torch.save(cases, tmp_path / "cases.pt")
    env = {**os.environ, "MINISGL_CPU_ISA": isa}
    args = [sys.executable, "-c", AVX2_RUN, str(tmp_path / "cases.pt"), str(tmp_path / "out.pt")]
    subprocess.run(args, env=env, check=True, timeout=600)
    expected = [torch.ops.minisgl.qdot_mm(*case) for case in cases]
    for outs in torch.load(tmp_path / "out.pt"):
        assert all(torch.equal(a, b) for a, b in zip(outs, expected, strict=True))


def test_isa_choice(monkeypatch):
    """The AVX512 build here by default, another when asked, a clear error for a name that is
    none."""
    monkeypatch.delenv("MINISGL_CPU_ISA", raising=False)
    assert native.wanted() == "avx512" and native.float32_kernels()
    monkeypatch.setenv("MINISGL_CPU_ISA", "AVX2")
    assert native.wanted() == "avx2"
    monkeypatch.setenv("MINISGL_CPU_ISA", "sse2")
    with pytest.raises(
        ValueError, match="MINISGL_CPU_ISA='sse2': expected one of avx512, avxvnni, avx2"
    ):
        native.wanted()


@pytest.fixture
def fresh_kernel(monkeypatch, tmp_path):
    """native_kernel() decided again under this test's environment, and again after it."""
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path))
    native.native_kernel.cache_clear()
    yield
    native.native_kernel.cache_clear()


def test_off_by_environment(fresh_kernel, monkeypatch):
    monkeypatch.setenv("MINISGL_CPU_NATIVE", "0")
    blocks, _ = gguf_blocks(Q.Q4_1)
    assert native.native_kernel() is None
    assert isinstance(from_blocks([blocks], torch.bfloat16), Int4Linear)


def test_no_compiler_falls_back_in_one_line(fresh_kernel, monkeypatch, capfd, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    assert native.native_kernel() is None
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the native CPU kernels did not build or load" in err[0]
    assert "torch's kernels instead" in err[0]


def test_built_once_into_the_cache(fresh_kernel, tmp_path):
    assert native.native_kernel() is not None
    built = list((tmp_path / "kernels").glob("qdot-*.so"))
    assert len(built) == 1 and os.listdir(tmp_path / "kernels") == [built[0].name]  # no objects
    stamp = built[0].stat().st_mtime_ns
    native.native_kernel.cache_clear()
    assert native.native_kernel() is not None and built[0].stat().st_mtime_ns == stamp


def fake_builds(monkeypatch: pytest.MonkeyPatch, seconds: float) -> list[str]:
    """native.build replaced: it takes `seconds`, writes an empty file and records the name of
    the thread that ran it."""
    threads: list[str] = []

    def build(cxx: str, path: str, isa: str) -> None:
        threads.append(threading.current_thread().name)
        time.sleep(seconds)
        open(path, "w").close()

    monkeypatch.setattr(native, "build", build)
    return threads


def library() -> str:
    cxx, isa = native.compiler(), native.wanted()
    assert cxx is not None and isa is not None
    return native.library_path(cxx, isa)


def test_builds_wait_for_the_one_under_way(fresh_kernel, monkeypatch):
    """Two processes that find no kernels (the launcher's early build and a scheduler, two test
    workers) build them once: the second waits under the folder's lock, then finds them."""
    builds, path = fake_builds(monkeypatch, 0.5), library()
    args = (native.compiler(), path, native.wanted())
    threads = [threading.Thread(target=native.ensure_built, args=args) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(builds) == 1 and os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


def test_a_first_conversion_builds_the_kernels_meanwhile(fresh_kernel, monkeypatch, tmp_path):
    """The launcher converting a GGUF (a first start) starts the kernels' build in a thread, so
    the engine's process finds them built (or waits for them); not with CUDA, not once
    converted."""
    from support.gguf_files import write_gguf

    model = str(tmp_path / "tiny.gguf")
    write_gguf("llama", model)
    builds, path = fake_builds(monkeypatch, 0.5), library()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    convert = extensions().gguf_model
    assert convert is not None
    convert(model)
    assert builds == [] and not os.path.exists(path)  # CUDA: the engine's own kernels
    os.utime(model)  # converted again, without CUDA
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    convert(model)
    for thread in threading.enumerate():
        if thread.name == "kernels":
            thread.join(10)
    assert builds == ["kernels"] and os.path.isfile(path)
    native.ensure_built(native.compiler(), path, native.wanted())  # the scheduler: found
    assert builds == ["kernels"]
    os.remove(path)
    convert(model)  # converted: a warm start starts nothing
    assert builds == ["kernels"]


def test_a_source_that_fails_to_compile_is_said_in_one_line(fresh_kernel, monkeypatch, capfd):
    """The sources compile in parallel: one failing (ops.cpp here) gives its compiler's first
    error line, torch's kernels, and nothing left in the cache."""
    real = native.compiler()
    cxx = os.path.join(os.environ["MINISGL_CACHE_DIR"], "cxx")
    with open(cxx, "w") as f:
        f.write(f'#!/bin/sh\ncase "$*" in *ops.cpp*) echo "ops.cpp:1: error: boom" >&2; exit 1;; esac\n'
                f'exec {real} "$@"\n')  # fmt: skip
    os.chmod(cxx, 0o755)
    monkeypatch.setenv("CXX", cxx)
    assert native.native_kernel() is None
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "(ops.cpp:1: error: boom); torch's kernels instead" in err[0], err
    assert os.listdir(os.path.join(os.environ["MINISGL_CACHE_DIR"], "kernels")) == []


def test_a_file_that_does_not_load_is_removed(fresh_kernel, capfd):
    """One line, torch's kernels, and the next start builds it again."""
    compiler = native.compiler()
    assert compiler is not None
    path = native.library_path(compiler, native.wanted())
    os.makedirs(os.path.dirname(path))
    with open(path, "wb") as f:
        f.write(b"not a library")
    assert native.native_kernel() is None and not os.path.exists(path)
    assert "did not build or load" in capfd.readouterr().err


def test_prune_packed_removes_other_files_unused_for_a_week(tmp_path):
    used, recent, old = (tmp_path / f"packed-{n}.st" for n in ("4-vnni", "4-torch", "3"))
    for path in (used, recent, old):
        path.write_bytes(b"x")
    week_ago = time.time() - 8 * 86400
    for path in (used, old):
        os.utime(path, (week_ago, week_ago))
    prune_packed(str(used))
    assert used.exists() and recent.exists() and not old.exists()
    assert time.time() - used.stat().st_mtime < 60  # touched: in use
