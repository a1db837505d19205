"""The server's start-up warm-up (ext/serving's `warm_up`, run on a GPU or a compiled CPU engine
unless --skip-server-warmup): it leaves no trace — no page held, an empty prefix cache,
counters at zero — and the requests after it get the same tokens as on a fresh engine."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams
from minisgl.ext.serving.warmup import warm_up
from minisgl.server.args import parse_args
from support.invariants import check_no_leak
from support.server import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("models") / "tiny"))


def test_warm_up_leaves_no_trace(model_dir: str) -> None:
    prompts = [[5, 6, 7, 8], list(range(3, 60))]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    fresh = LLM(model_dir, device="cpu", page_size=4, num_pages=600)
    expected = fresh.generate(prompts, params, use_tqdm=False)
    fresh.shutdown()
    llm = LLM(model_dir, device="cpu", page_size=4, num_pages=600)
    try:
        scheduler = llm.scheduler
        warm_up(scheduler)
        planner = scheduler.planner
        assert planner.num_prefill_tokens == planner.num_cached_tokens == 0
        assert scheduler.cache.prefix_cache.num_pages == 0 and not scheduler.has_work
        check_no_leak(scheduler)
        assert llm.generate(prompts, params, use_tqdm=False) == expected
    finally:
        llm.shutdown()


def test_skip_server_warmup_flag() -> None:
    from minisgl.ext.serving.options import serving_options

    assert serving_options(parse_args(["--skip-server-warmup"])).skip_server_warmup
    assert not serving_options(parse_args([])).skip_server_warmup
