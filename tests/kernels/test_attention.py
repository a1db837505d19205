"""Attention backend choice (--attn parsing, auto rule, hybrid dispatch, clear refusals), the
flat page-list gather of the fi backend, and the Triton kernels through Triton's CPU
interpreter. The GPU comparisons are in test_attention_gpu.py."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

import minisgl.attention as attn
from minisgl.attention import auto_backend, create_attention_backend, parse_attn
from minisgl.attention.base import BaseAttnBackend
from minisgl.attention.fi_backend import FlashInferAttnBackend, page_indices
from minisgl.attention.torch_backend import TorchAttnBackend
from minisgl.core import Batch, Req, SamplingParams
from minisgl.ext.perf.hybrid import HybridAttnBackend
from minisgl.extension import ExtensionMissing

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("auto", ("auto", "auto")),
        ("torch", ("torch", "torch")),
        ("FI", ("fi", "fi")),
        ("fi,triton", ("fi", "triton")),
        (" triton , torch ", ("triton", "torch")),
    ],
)
def test_parse_attn(value, expected):
    assert parse_attn(value) == expected


@pytest.mark.parametrize("value", ["flash", "fa", "", "fi,", "auto,fi", "fi,triton,torch"])
def test_parse_attn_rejects_with_the_choices(value):
    with pytest.raises(ValueError, match="one of fi, triton, torch, or PREFILL,DECODE"):
        parse_attn(value)


def test_a_backend_pair_needs_the_perf_extension(core_alone, capsys):
    """Without ext/perf a PREFILL,DECODE pair of two backends is refused naming it (a CLI
    error naming --attn); one backend, or a pair of the same, runs as before."""
    from minisgl.server.args import parse_args

    assert parse_attn("torch,torch") == ("torch", "torch")
    with pytest.raises(ExtensionMissing, match="'fi,triton' needs the perf extension"):
        parse_attn("fi,triton")
    if importlib.util.find_spec("triton") is not None:  # both backends made, then refused
        with pytest.raises(ExtensionMissing, match="needs the perf extension"):
            create_attention_backend(("triton", "torch"), CPU)
    with pytest.raises(SystemExit) as exc:
        parse_args(["--attn", "torch,triton"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "argument --attn:" in err and "perf extension" in err


def test_cli_attn_error_is_one_line_naming_the_flag(capsys):
    from minisgl.server.args import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(["--attn", "flashattn"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.count("\n") == 1
    assert "argument --attn: unknown attention backend 'flashattn'" in err
    assert "fi, triton, torch" in err


def test_llm_attn_kwarg_is_checked_the_same_way(model_dirs):
    from minisgl import LLM

    path, _ = model_dirs("llama")
    with pytest.raises(ValueError, match="unknown attention backend 'flash'.*fi, triton, torch"):
        LLM(path, device="cpu", attn="flash", num_pages=8)
    llm = LLM(path, device="cpu", attn="torch,torch", num_pages=8)
    llm.shutdown()


@pytest.mark.parametrize("have_fi", [True, False])
def test_auto_rule(monkeypatch, have_fi):
    monkeypatch.setattr(attn, "flashinfer_available", lambda: have_fi)
    bf16, fp32 = torch.bfloat16, torch.float32

    def fi_or(other: str) -> str:
        return "fi" if have_fi else other

    assert auto_backend(CPU, bf16, None) == "torch"
    assert auto_backend(CPU, fp32, 4096) == "torch"
    assert auto_backend(CUDA, bf16, None) == "triton"  # measured faster than fi on the H100
    assert auto_backend(CUDA, None, None) == "triton"
    assert auto_backend(CUDA, torch.float16, 4096) == fi_or("torch")
    assert auto_backend(CUDA, fp32, None) == "triton"  # flashinfer has no float32
    assert auto_backend(CUDA, fp32, 4096) == "torch"  # nor does triton have windows


def test_create_on_cpu():
    assert isinstance(create_attention_backend("auto", CPU), TorchAttnBackend)
    assert isinstance(create_attention_backend("torch,torch", CPU), TorchAttnBackend)
    if importlib.util.find_spec("triton") is None:  # CI: a CPU-only install
        with pytest.raises(ValueError, match="needs the triton package"):
            create_attention_backend("triton,torch", CPU)
    else:
        hybrid = create_attention_backend("triton,torch", CPU)
        assert isinstance(hybrid, HybridAttnBackend) and hybrid.name == "triton,torch"
        assert (hybrid.prefill.name, hybrid.decode.name) == ("triton", "torch")
    with pytest.raises(ValueError, match="one of fi, triton, torch"):
        create_attention_backend("flash", CPU)
    with pytest.raises(ValueError, match="sliding windows"):
        create_attention_backend("triton", CPU, 4096)


def test_triton_fuses_rope_for_one_request_decode_steps_only(monkeypatch):
    """RoPE inside the decode kernel is for a lone request's decode step: the rows of one
    request (verification, prompts as rows) would read K/V that other programs of the same
    launch store, and at large batches the rotary kernel was measured faster."""
    pytest.importorskip("triton")
    backend = create_attention_backend("triton", CPU)
    req = Req([1, 2, 3, 4], 3, SamplingParams(), 8, cached_len=3, extend_len=1)
    assert backend.fuses_rope(Batch([req], "decode"))
    assert not backend.fuses_rope(Batch([req, req], "decode"))
    assert not backend.fuses_rope(Batch([req], "prefill"))
    hybrid = create_attention_backend("torch,triton", CPU)
    assert hybrid.fuses_rope(Batch([req], "decode"))
    assert not hybrid.fuses_rope(Batch([req], "prefill"))
    monkeypatch.setenv("MINISGL_DISABLE_DECODE_ROPE", "1")
    assert not backend.fuses_rope(Batch([req], "decode"))


def test_fi_refusals_are_clear():
    with pytest.raises(ValueError, match="does not support float32"):
        create_attention_backend("fi", CUDA, dtype=torch.float32, num_qo_heads=8)
    with pytest.raises(ValueError, match="needs CUDA"):
        FlashInferAttnBackend(CPU, 8, torch.bfloat16)
    with pytest.raises(ValueError, match="needs num_qo_heads"):
        create_attention_backend("fi", CUDA, dtype=torch.bfloat16)
    if not attn.flashinfer_available():
        with pytest.raises(ValueError, match="needs flashinfer"):
            FlashInferAttnBackend(CUDA, 8, torch.bfloat16)


def test_torch_backend_has_no_graphs():
    with pytest.raises(NotImplementedError, match="torch attention backend"):
        TorchAttnBackend().init_cuda_graph(8)


class Recorder(BaseAttnBackend):
    def __init__(self, name: str, calls: list) -> None:
        self.name, self.calls = name, calls

    def prepare(self, batch):
        self.calls.append((self.name, "prepare"))

    def forward(self, q, layer_id, scale, batch):
        self.calls.append((self.name, "forward"))
        return q

    def init_cuda_graph(self, max_bs):
        self.calls.append((self.name, "init_cuda_graph"))

    def prepare_for_capture(self, batch):
        self.calls.append((self.name, "capture"))

    def prepare_for_replay(self, batch):
        self.calls.append((self.name, "replay"))


def test_hybrid_dispatches_on_phase():
    calls: list = []
    hybrid = HybridAttnBackend(Recorder("P", calls), Recorder("D", calls))
    req = Req([1, 2], 2, SamplingParams(), 8)
    q = torch.zeros(1, 2, 4)
    for phase in ("prefill", "decode"):
        batch = Batch([req], phase)  # type: ignore[arg-type]
        hybrid.prepare(batch)
        hybrid.forward(q, 0, 1.0, batch)
    hybrid.init_cuda_graph(4)
    hybrid.prepare_for_capture(batch)
    hybrid.prepare_for_replay(batch)
    assert calls == [
        ("P", "prepare"),
        ("P", "forward"),
        ("D", "prepare"),
        ("D", "forward"),
        ("D", "init_cuda_graph"),
        ("D", "capture"),
        ("D", "replay"),
    ]


def test_page_indices_gathers_each_requests_pages():
    table = torch.arange(60, dtype=torch.int32).view(6, 10) * 7
    rows = torch.tensor([4, 0, 5], dtype=torch.int32)
    counts = [3, 1, 10]
    indptr = torch.tensor([0, 3, 4, 14], dtype=torch.int32)
    got = page_indices(table, rows, indptr, 14)
    want = torch.cat([table[r, :n] for r, n in zip(rows.tolist(), counts)])
    assert got.dtype == torch.int32 and got.tolist() == want.tolist()


def test_triton_kernels_in_interpreter_match_torch_backend():
    pytest.importorskip("triton")
    tests_dir = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = os.path.join(tests_dir, "support", "triton_interpret_check.py")
    python_dir = os.path.join(tests_dir, "..", "python")
    path = os.pathsep.join(filter(None, [python_dir, tests_dir, os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    res = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_triton_metadata_rows_start_16_byte_aligned():
    """Triton compiles a kernel variant per pointer alignment: the metadata rows must start
    16-byte aligned for every batch size, or a batch size first met mid-run compiles one."""
    pytest.importorskip("triton")
    from support.attn import make_problem

    for n in range(1, 10):
        for graph in (False, True):
            batch, *_ = make_problem(
                [(5 + i, 1) for i in range(n)], 16, 32, torch.float32, True, CPU
            )
            backend = create_attention_backend("triton", CPU)
            backend.init_cuda_graph(7)
            if graph and n <= 7:
                backend.prepare_for_capture(batch)  # the graph's buffers, refilled by a replay
                backend.prepare_for_replay(batch)
            else:
                backend.prepare(batch)
            md = batch.attn_metadata
            fields = (md.rows, md.cached_lens, md.extend_lens, md.kv_lens, md.q_starts, md.order)
            assert all(t.data_ptr() % 16 == 0 and t.shape == (n,) for t in fields), (n, graph)
            assert md.kv_lens.tolist() == [6 + i for i in range(n)]
            assert md.order.tolist() == list(reversed(range(n)))  # the longest request first


@pytest.mark.skipif(torch.cuda.is_available(), reason="the smoke run is the CPU one")
@pytest.mark.parametrize(
    "script, argv, num_rows",
    [
        ("decode_attention_bench.py", ["--block-n", "16"], 2),  # bf16 and fp8 pools
        ("decode_replay_bench.py", [], 1),  # the default run's decode steps, bf16
        (
            "extend_attention_bench.py",
            ["--block-m", "16,32", "--block-n", "16", "--decode-rows", "2"],
            2,
        ),
    ],
)
def test_attention_benchmark_smoke(script, argv, num_rows):
    """benchmark/kernels/*_attention_bench.py and decode_replay_bench.py --smoke run the kernel
    interpreted, check each configuration against its float32 reference and print a row for
    each."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    path = os.path.join(root, "benchmark", "kernels", script)
    env = dict(os.environ, PYTHONPATH=os.path.join(root, "python"))
    res = subprocess.run(
        [sys.executable, path, "--smoke", *argv],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line for line in res.stdout.splitlines() if "block_n" in line and "us" in line]
    assert len(rows) == num_rows and "WRONG" not in res.stdout, res.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusals of a machine without CUDA")
def test_fi_decode_bench_needs_cuda(capsys):
    """benchmark/kernels/fi_decode_bench.py (flashinfer against the Triton kernel) says it runs
    on CUDA only: no --smoke, exit 2 without a GPU (tests/gpu runs it)."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmark", "kernels"))
    from fi_decode_bench import main

    with pytest.raises(SystemExit) as refused:
        main(["--smoke"])
    assert refused.value.code == 2 and "CUDA only" in capsys.readouterr().err
    assert main([]) == 2 and "CUDA only" in capsys.readouterr().out


def test_decode_kernel_compiles_for_hopper_within_its_register_budget():
    """The decode kernel compiles for sm_90 at small head dims and with RoPE inside (the
    interpreter does not check tl.dot's shapes), and with RoPE inside it does not spill. The
    fp8 tile reads int16 pairs of dims (`e4m3_pairs`): no byte loads from shared memory in
    its loop (97 a block before, with 178 IMADs packing them) and at most 96 registers, so
    five programs of 4 warps fit an SM (Triton 3.6 and 3.9: 96; 122 before). The bf16 tiles
    must not spill. Compiled for sm_90 on the CPU by benchmark/kernels/inspect_kernels.py, so
    a Triton upgrade or a kernel edit that changes this shows here, before any GPU run."""
    pytest.importorskip("triton")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "benchmark", "kernels"))
    import inspect_kernels

    if not inspect_kernels.tools_available():
        pytest.skip("this Triton has no NVIDIA ptxas")
    path = os.path.join(root, "benchmark", "kernels", "inspect_kernels.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # test_gemv sets it

    def compile_for_hopper(*argv: str) -> str:
        run = [sys.executable, path, "--kv-dtype", "fp8_e4m3,bf16", *argv]
        res = subprocess.run(run, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        return res.stdout

    # one part of head_dim below 32 (tl.dot's 16 columns), RoPE inside as one request runs it;
    # there the first KV block is held in registers across the PDL wait, without spilling
    rope = compile_for_hopper("--num-splits", "32", "--head-dim", "16,64,128", "--rope")
    rope_lines = [line for line in rope.splitlines() if "decode_tuning's" in line]
    assert len(rope_lines) == 6 and all("0 spills" in line for line in rope_lines), rope
    stdout = compile_for_hopper("--num-splits", "1", "--mix")
    fp8, bf16 = (line for line in stdout.splitlines() if "decode_tuning's" in line)
    registers = int(re.search(r"(\d+) registers", fp8).group(1))  # type: ignore[union-attr]
    assert "fp8_e4m3" in fp8 and registers <= 96 and "0 spills" in fp8, stdout
    assert "bf16" in bf16 and "0 spills" in bf16, stdout
    # the main loop is found: one KV block's body has hundreds of instructions (358 for bf16,
    # 405 for fp8 with Triton 3.9); the fp8 loop's shared-memory loads are ldmatrix, not LDS
    blocks = [int(n) for n in re.findall(r"(\d+) instructions a block", stdout)]
    assert len(blocks) == 2 and min(blocks) > 100, stdout
    fp8_mix = stdout.splitlines()[stdout.splitlines().index(fp8) + 1]
    byte_loads = re.search(r"\bLDS (\d+)", fp8_mix)
    assert byte_loads is None or int(byte_loads.group(1)) <= 16, fp8_mix


def test_extend_tuning_follows_the_measurements(monkeypatch):
    """The extend kernel's tiles: Hopper's measured (64, 64, 4 warps, 3 stages) only for 16-bit
    head_dim 128; every other case keeps the tiles it had."""
    pytest.importorskip("triton")
    from types import SimpleNamespace

    from minisgl.kernel import triton_attention as ta

    def q(dim: int, dtype: torch.dtype, cuda: bool = True) -> SimpleNamespace:
        device = SimpleNamespace(index=0 if cuda else None)
        return SimpleNamespace(shape=(7, 16, dim), dtype=dtype, is_cuda=cuda, device=device)

    for is_hopper in (True, False):
        monkeypatch.setattr(ta, "hopper", lambda index, h=is_hopper: h)
        new = (64, 64, 4, 3) if is_hopper else (32, 32, 4, 2)
        assert ta.extend_tuning(q(128, torch.bfloat16)) == new
        assert ta.extend_tuning(q(128, torch.float16)) == new
        assert ta.extend_tuning(q(128, torch.bfloat16, cuda=False)) == (32, 32, 4, 2)
        assert ta.extend_tuning(q(256, torch.bfloat16)) == (32, 32, 4, 2)
        assert ta.extend_tuning(q(128, torch.float32)) == (32, 32, 4, 2)
        assert ta.extend_tuning(q(64, torch.bfloat16)) == (64, 64, 4, 2)
        assert ta.extend_tuning(q(64, torch.float32)) == (32, 64, 4, 2)
