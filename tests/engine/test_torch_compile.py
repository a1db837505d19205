"""--enable-torch-compile: one-request decode steps run the compiled decoder, with transformers'
greedy tokens in float32; batches stay eager (no second compile); refused where one graph
cannot hold the decoder."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM, SamplingParams
from minisgl.ext.cpu.torch_compile import check_torch_compile
from minisgl.ext.serving.warmup import needs_warm_up, warm_up_when_needed
from minisgl.utils.options import OptionError
from support.cache import link_kernels
from support.invariants import check_no_leak
from support.models import follows, hf_greedy


def test_compiled_decode_equals_transformers(model_dirs):
    from torch._dynamo.utils import counters

    path, hf = model_dirs("llama")
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(path, page_size=4, num_pages=128, enable_torch_compile=True)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = hf_greedy(hf, prompt, 12)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    assert llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"] == want
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 1  # every decode step of any KV length ran the one compiled graph
    # two requests decode eagerly; the longer one's last steps alone run the compiled graph
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    outs = llm.generate([prompt, prompt[:5]], [params, short], use_tqdm=False)
    assert outs[0]["token_ids"] == want and outs[1]["token_ids"] == hf_greedy(hf, prompt[:5], 4)
    assert counters["stats"]["unique_graphs"] == graphs
    check_no_leak(llm.scheduler)


@pytest.mark.parametrize(
    "device, tp, moe, why",
    [("cuda", 1, False, "for cpu"), ("cpu", 2, False, "--tp 1"), ("cpu", 1, True, "MoE")],
)
def test_refused_where_one_graph_cannot_hold_the_decoder(device, tp, moe, why):
    with pytest.raises(OptionError, match=f"--enable-torch-compile: .*{why}") as e:
        check_torch_compile(torch.device(device), tp, moe)
    assert e.value.name == "enable_torch_compile"


def test_compiled_quantized_decode_equals_eager(tmp_path, monkeypatch):
    """The GGUF layers inside the graph: eager's greedy tokens, up to a near tie (inductor rounds
    bfloat16 otherwise)."""
    from support.gguf_files import write_gguf

    monkeypatch.setenv("MINISGL_CACHE_DIR", link_kernels(tmp_path / "cache"))
    path = str(tmp_path / "tiny.gguf")
    write_gguf("llama", path)
    prompt = [5, 77, 300, 12, 400, 3, 9, 81]
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=2)
    outs = []
    for compiled in (False, True):
        llm = LLM(path, quantization="gguf", dtype="bfloat16", page_size=4, num_pages=64,
                  enable_torch_compile=compiled)  # fmt: skip
        outs.append(llm.generate([prompt], params, use_tqdm=False)[0])
        check_no_leak(llm.scheduler)
    follows(outs[1], outs[0])


def test_server_warm_up_compiles_the_graph(model_dirs):
    """The server warms a compiled engine up (eager CPU engines skip it), ending with a lone
    request so that the compile happens before the first user's."""
    from torch._dynamo.utils import counters

    path, _ = model_dirs("llama")
    assert not needs_warm_up(LLM(path, page_size=4, num_pages=128).engine)
    torch._dynamo.reset()
    counters.clear()
    llm = LLM(path, page_size=4, num_pages=128, enable_torch_compile=True)
    assert needs_warm_up(llm.engine)
    warm_up_when_needed(llm.scheduler)
    assert counters["stats"]["unique_graphs"] == 1
    check_no_leak(llm.scheduler)


def test_flag():
    from minisgl.server.args import parse_args

    assert parse_args(["--enable-torch-compile"]).scheduler.extras["cpu"].enable_torch_compile
    assert not parse_args([]).scheduler.extras["cpu"].enable_torch_compile


def test_needs_the_torch_attention_backend():
    from minisgl.attention.torch_backend import TorchAttnBackend
    from minisgl.ext.cpu.torch_compile import mark_kv_len_dynamic
    from minisgl.ext.perf.hybrid import HybridAttnBackend
    from support.attn import make_problem

    with pytest.raises(OptionError, match="torch attention backend"):
        mark_kv_len_dynamic(HybridAttnBackend(TorchAttnBackend(), TorchAttnBackend()))
    plain, backend = TorchAttnBackend(), TorchAttnBackend()
    mark_kv_len_dynamic(backend)
    for marked in (False, True):  # the KV slots [B, max KV length]: their length is dynamic
        batch, *_ = make_problem([(5, 1), (9, 1)], 4, 16, torch.float32, True, torch.device("cpu"))
        (backend if marked else plain).prepare(batch)
        dynamic = getattr(batch.attn_metadata.kv_slots, "_dynamo_weak_dynamic_indices", set())
        assert dynamic == ({1} if marked else set())
