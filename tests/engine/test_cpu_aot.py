"""--cpu-compile aot (the default on CPU): decode steps run layers compiled ahead of time (one
kind for one request, one for batches), built at the first start into the cache and loaded at
later ones, following eager's greedy tokens on the quantized path (up to near ties: the
compiled layers round bfloat16 otherwise); a corrupt artifact or a failed build falls back to
eager with one line saying why."""

from __future__ import annotations

import os
import warnings
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.cpu import aot, native
from support.cache import link_kernels
from support.invariants import check_no_leak
from support.models import follows

PROMPT = [5, 77, 300, 12, 400, 3, 9, 81]
PARAMS = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)


@pytest.fixture
def tiny_gguf(tmp_path, monkeypatch):
    """A tiny GGUF in a fresh cache, the step turned on: Q4_0 / Q4_1 / Q8_0 / F16 parts, each
    layer's alike (one kind of layer: each kind of step is built once, ~13 s on 2 cores)."""
    from support.gguf_files import Q, write_gguf

    monkeypatch.setenv("MINISGL_CACHE_DIR", link_kernels(tmp_path / "cache"))
    monkeypatch.setenv("MINISGL_CPU_AOT", "1")
    path = str(tmp_path / "tiny.gguf")
    # the 2-D tensors in turn: the embedding, then each layer's q, k, v, o, gate, up, down
    write_gguf("llama", path, qtypes=[Q.Q4_0, Q.Q8_0, Q.Q8_0, Q.Q8_0, Q.Q4_1, Q.Q4_0, Q.F16])
    return path


def generate(path: str, **options) -> tuple[LLM, dict]:
    llm = LLM(path, quantization="gguf", dtype="bfloat16", page_size=4, num_pages=64, **options)
    out = llm.generate([PROMPT], PARAMS, use_tqdm=False)[0]
    check_no_leak(llm.scheduler)
    return llm, out


def artifacts(llm: LLM) -> list[str]:
    model_dir = llm.engine.model_path
    return sorted(f for f in os.listdir(model_dir) if f.startswith(aot.PREFIX))


def dry_compiles(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each ISA check inductor makes from now on is the dry compile of its vector
    headers (torch's checks forgotten first: they are cached once a process)."""
    import torch._inductor.cpu_vec_isa as isa

    classes = [c for c in vars(isa).values() if isinstance(c, type) and issubclass(c, isa.VecISA)]
    for cached in [isa.valid_vec_isa_list, *(v for c in classes for v in vars(c).values())]:
        if hasattr(cached, "cache_clear"):
            cached.cache_clear()
    dry: list[bool] = []
    check = isa.VecISA.check_build

    def spy(self: isa.VecISA, code: str) -> bool:
        dry.append(code == isa.VecISA._avx_code)
        return check(self, code)

    monkeypatch.setattr(isa.VecISA, "check_build", spy)
    return dry


def precompiled_headers(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The headers inductor precompiles from now on."""
    from torch._inductor import codecache

    made: list[str] = []
    precompile = codecache._precompile_header

    def spy(header: str, *args: Any, **kwargs: Any) -> str:
        made.append(header)
        return precompile(header, *args, **kwargs)

    monkeypatch.setattr(codecache, "_precompile_header", spy)
    return made


def test_built_once_then_loaded_with_eagers_tokens(tiny_gguf, capfd, monkeypatch):
    eager, want = generate(tiny_gguf, cpu_compile="off")
    assert eager.engine.compiled_decoder is None
    short = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=2)
    prompts, params = [PROMPT, PROMPT[:5]], [PARAMS, short]
    eager_outs = eager.generate(prompts, params, use_tqdm=False)  # (an engine sets the context)
    dry, headers = dry_compiles(monkeypatch), precompiled_headers(monkeypatch)
    with warnings.catch_warnings():  # torch's own deprecations inside export are not the user's
        warnings.simplefilter("error", FutureWarning)
        llm, got = generate(tiny_gguf)
    # the native kernels loaded: inductor trusts the CPU's vector ISAs (3.8 s of 11 on 2 cores)
    assert not any(dry) if native.native_kernel() is not None else any(dry), dry
    assert headers == []  # none made (~8 s and 283 MB in /tmp at a first build)
    assert isinstance(llm.engine.compiled_decoder, aot.AotDecoder)
    follows(got, want)
    err = capfd.readouterr().err
    assert "compiling the decoder layer for decode steps once" in err
    assert "compiling the decoder layer for batched decode steps once" in err
    names = artifacts(llm)  # beside the conversion: one for each kind of layer and of step
    kinds = {id(step) for step in aot.layer_steps(llm.engine)}
    assert len(names) == 2 * len(kinds) and all(n.endswith(".pt2") for n in names)
    again, loaded = generate(tiny_gguf)  # a later start: loaded, not compiled
    assert isinstance(again.engine.compiled_decoder, aot.AotDecoder) and loaded == got
    assert "compiling" not in capfd.readouterr().err
    # a batch of two (other lengths: masked) through the batched layers, the longer one's lone
    # steps through the one-request layers: eager's tokens
    decoder, steps = again.engine.compiled_decoder, []
    assert decoder.batched_runs is not None
    decoder.batched_runs = [counted(run, steps) for run in decoder.batched_runs]
    outs = again.generate(prompts, params, use_tqdm=False)
    for out, eager_out in zip(outs, eager_outs, strict=True):
        follows(out, eager_out)
    assert len(steps) == 3 * len(decoder.runs)
    threads = torch.get_num_threads()
    try:  # the thread governor moves the steps between counts: the same tokens on two
        torch.set_num_threads(2)
        assert again.generate([PROMPT], PARAMS, use_tqdm=False)[0] == got
    finally:
        torch.set_num_threads(threads)
    # one request at a time (the shell's default) never runs a batch: its kind is left out
    # (were it wanted, its artifact, in the cache now, would be loaded)
    alone, one = generate(tiny_gguf, max_running_requests=1)
    assert alone.engine.compiled_decoder.batched_runs is None and one == got
    check_no_leak(again.scheduler)


def counted(run: aot.Run, calls: list[int]) -> aot.Run:
    def call(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        calls.append(len(inputs))
        return run(inputs)

    return call


def flagged(run: aot.Run, inside: list[bool]) -> aot.Run:
    """`run`, with `inside` holding True while it runs."""

    def call(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        inside.append(True)
        try:
            return run(inputs)
        finally:
            inside.pop()

    return call


def spy_packed(monkeypatch: pytest.MonkeyPatch, inside: list[bool]) -> list[bool]:
    """Whether each product on oneDNN's packed weight from now on ran inside a `flagged` run."""
    from minisgl.ext.cpu import packed

    calls: list[bool] = []
    onednn = packed.onednn_linear

    def spy(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        calls.append(bool(inside))
        return onednn(x, w, b)

    monkeypatch.setattr(packed, "onednn_linear", spy)
    return calls


def test_the_thread_governor_governs_the_compiled_layers():
    from minisgl.ext.cpu.threads import GovernedThreads
    from minisgl.ext.cpu.torch_compile import OneRequestCompiled

    keys = []
    governor = SimpleNamespace(step=keys.append)
    model = SimpleNamespace(model=object())
    compiled = object.__new__(aot.AotDecoder)  # its kind is what counts
    jit = object.__new__(OneRequestCompiled)  # torch.compile's: compiled for one request
    for size in (1, 3):
        batch = SimpleNamespace(size=size, is_decode=True)
        for decoder in (model.model, compiled, jit):  # eager, AOT, torch.compile's
            engine = SimpleNamespace(model=model, decoder=lambda batch, d=decoder: d)
            GovernedThreads(governor).forward(engine, batch, [False], False)
    assert keys == [1, 1, None, 3, 3, 3]  # None: every core; torch.compile's batches: eager


def test_layers_of_two_kinds_get_two_steps_and_two_artifacts(tmp_path, monkeypatch):
    """Layers whose quantized parts differ (the default mix, cycling through the layers) are
    two kinds of layer: a step and an artifact path each; layers alike share them."""
    from support.gguf_files import write_gguf

    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    path = str(tmp_path / "mixed.gguf")
    write_gguf("llama", path)
    llm = LLM(path, quantization="gguf", dtype="bfloat16", num_pages=16, cpu_compile="off")
    first, second = aot.layer_steps(llm.engine)
    assert first is not second and first.signature() != second.signature()
    paths = {aot.artifact_path(llm.engine, step) for step in (first, second)}
    assert len(paths) == 2


def test_corrupt_artifact_falls_back_to_eager(tiny_gguf, capfd, monkeypatch):
    eager, want = generate(tiny_gguf, cpu_compile="off")
    path = aot.artifact_path(eager.engine, aot.layer_steps(eager.engine)[0])
    with open(path, "wb") as f:
        f.write(b"not a package")
    monkeypatch.setattr(aot, "build", lambda step, path: pytest.fail("built instead of loaded"))
    llm, got = generate(tiny_gguf)
    assert llm.engine.compiled_decoder is None and got == want
    err = capfd.readouterr().err
    assert f"eager decode: could not load {path}" in err and "removed it" in err
    assert not os.path.exists(path)  # the next start builds it again


def test_failed_build_falls_back_to_eager_once(tiny_gguf, capfd, monkeypatch):
    def fail(step, path):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(aot, "build", fail)
    eager, want = generate(tiny_gguf, cpu_compile="off")
    llm, got = generate(tiny_gguf)
    assert llm.engine.compiled_decoder is None and got == want
    err = capfd.readouterr().err
    assert (
        "eager decode: could not compile the decoder layer (RuntimeError: no C++ compiler)" in err
    )
    monkeypatch.setattr(aot, "build", lambda step, path: pytest.fail("built again"))
    generate(tiny_gguf)  # a later start does not try again, and says so
    assert "failed earlier (RuntimeError: no C++ compiler)" in capfd.readouterr().err


def test_off_by_flag_or_environment(tiny_gguf, monkeypatch):
    monkeypatch.setattr(aot, "build", lambda step, path: pytest.fail("built"))
    options = {"quantization": "gguf", "dtype": "bfloat16"}
    assert LLM(tiny_gguf, cpu_compile="off", **options).engine.compiled_decoder is None
    exact = LLM(tiny_gguf, quantization="none", dtype="float32", cpu_compile="off")
    assert exact.engine.compiled_decoder is None
    monkeypatch.setenv("MINISGL_CPU_AOT", "0")
    assert LLM(tiny_gguf, cpu_compile="aot", **options).engine.compiled_decoder is None


def test_float32_compiled_by_default_batches_and_off_intel_one_request(model_dirs, monkeypatch):
    """The exact path (float32, dense) compiles batched steps by default, and one request's
    steps where the rule already takes one row off F.linear (`packed.rule_for`: not on Intel,
    whose one-request steps stay eager, transformers' bits). --cpu-compile aot compiles both
    kinds (a checkpoint directory: the artifacts go to the cache's aot/). Where the rule takes
    them (a batch of 4+ on Intel, every row elsewhere), the compiled layers multiply on oneDNN's
    packed weights (`packed.packed_linear`). Greedy tokens are transformers' throughout."""
    from minisgl.ext.cpu.packed import PACKED_ATTR, pack_rule, packs_available, rule_for
    from support.models import hf_greedy

    monkeypatch.setenv("MINISGL_CPU_AOT", "1")
    path, hf = model_dirs("llama")
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8], [1, 6, 1, 8, 0, 3], [5, 7, 7, 2, 1]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [hf_greedy(hf, p, 12) for p in prompts]
    for mode in ("auto", "aot"):
        llm = LLM(path, page_size=4, num_pages=128, cpu_compile=mode)
        decoder, steps = llm.engine.compiled_decoder, []
        assert isinstance(decoder, aot.AotDecoder) and decoder.batched_runs is not None
        assert (decoder.runs is None) == (mode == "auto" and not pack_rule().takes(1, True))
        step = aot.layer_steps(llm.engine)[0]
        assert os.path.dirname(aot.artifact_path(llm.engine, step)).startswith(aot.cache_root())
        if decoder.runs is not None:  # one request's compiled layers follow the eager rule
            inside: list[bool] = []
            decoder.runs = [flagged(run, inside) for run in decoder.runs]
            spied = spy_packed(monkeypatch, inside)
        assert llm.generate(prompts[:1], params, use_tqdm=False)[0]["token_ids"] == want[0]
        if decoder.runs is not None:
            assert any(spied) == pack_rule().takes(1, decode=True)
        decoder.batched_runs = [counted(run, steps) for run in decoder.batched_runs]
        for batch in (prompts[:2], prompts):  # the batched layers (Intel: F.linear, then packed)
            outs = llm.generate(batch, params, use_tqdm=False)
            assert [o["token_ids"] for o in outs] == want[: len(batch)]
        assert len(steps) >= 2 * 11 and len(prompts) >= rule_for("GenuineIntel").min_rows
        qkv = llm.engine.model.model.layers[0].self_attn.qkv_proj.weight
        assert hasattr(qkv, PACKED_ATTR) == packs_available()
        check_no_leak(llm.scheduler)
    for vendor in ("GenuineIntel", "AuthenticAMD"):  # auto's kinds under each vendor's rule
        monkeypatch.setattr(aot, "pack_rule", lambda v=vendor: rule_for(v))
        decoder = LLM(path, page_size=4, num_pages=128).engine.compiled_decoder
        assert isinstance(decoder, aot.AotDecoder) and decoder.batched_runs is not None
        assert (decoder.runs is None) == (vendor == "GenuineIntel")


def test_flag():
    from minisgl.server.args import parse_args

    assert parse_args([]).scheduler.extras["cpu"].cpu_compile == "auto"
    assert parse_args(["--cpu-compile", "off"]).scheduler.extras["cpu"].cpu_compile == "off"


def test_lora_engines_stay_eager(model_dirs, monkeypatch):
    """LoRA's layers read each step's adapter slots: an exported layer would hold them fixed,
    so an engine whose model another extension transformed compiles nothing, even on request."""
    monkeypatch.setenv("MINISGL_CPU_AOT", "1")
    monkeypatch.setattr(aot, "build", lambda step, path: pytest.fail("built"))
    path, _ = model_dirs("llama")
    for mode in ("auto", "aot"):
        llm = LLM(path, page_size=4, num_pages=64, enable_lora=True, cpu_compile=mode)
        assert llm.engine.compiled_decoder is None


def test_the_source_is_read_once_a_process(monkeypatch):
    """Every layer's artifact path (of each kind) hashes minisgl's source: once (60 reads of
    ~190 files took 0.27 s of a warm start)."""
    from pathlib import Path

    reads: list[str] = []
    read = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self.name) or read(self))
    getattr(aot.source_digest, "cache_clear", lambda: None)()  # this process's: forgotten
    first = aot.source_digest()
    files = len(reads)
    assert files > 100 and "aot.py" in reads
    assert aot.source_digest() == first and len(reads) == files
