"""The sampling extension (`minisgl/ext/sampling`: penalties, logit_bias, min_tokens, logprobs)
and the grammars of the structured extension, as the core sees them (issue 46): with both the
SamplingParams fields they implement are checked by them and their step features attach to
the scheduler; the core alone (MINISGL_DISABLE_EXTENSIONS=1) refuses every such field with a
ValueError naming it and the extension, and serves the base sampling parameters as before.
The HTTP side: tests/server/test_ext_sampling_http.py."""

from __future__ import annotations

from typing import Any

import pytest

from minisgl import LLM, SamplingParams, extension
from minisgl.extension import ExtensionMissing
from support.server import make_tiny_model

REFUSED = [
    ("frequency_penalty", 0.5, "sampling"),
    ("presence_penalty", -0.5, "sampling"),
    ("repetition_penalty", 1.2, "sampling"),
    ("logit_bias", {"5": 1.0}, "sampling"),
    ("min_tokens", 2, "sampling"),
    ("logprobs", 0, "sampling"),
    ("prompt_logprobs", 1, "sampling"),
    ("json_schema", {"type": "object"}, "structured"),
    ("regex", "[ab]+", "structured"),
    ("ebnf", 'root ::= "a"', "structured"),
    ("structural_tag", '{"type": "structural_tag"}', "structured"),
]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny")))


def test_the_extensions_fill_their_points() -> None:
    points = extension.extensions()
    assert {name for name, _, _ in REFUSED} <= set(points.sampling_params)
    assert len(points.step_features) >= 4  # adjustments, logprobs, prompt logprobs, grammars
    assert SamplingParams(logit_bias={"5": 1}).get("logit_bias") == {5: 1.0}  # checked, normalized


@pytest.mark.core
@pytest.mark.parametrize(("name", "value", "ext"), REFUSED)
def test_fields_need_their_extension(core_alone: None, name: str, value: Any, ext: str) -> None:
    with pytest.raises(ExtensionMissing) as info:
        SamplingParams(**{name: value})
    assert isinstance(info.value, ValueError)
    assert str(info.value) == f"{name} needs the {ext} extension (minisgl/ext/{ext})"


@pytest.mark.core
def test_defaults_and_base_parameters_need_nothing(core_alone: None) -> None:
    SamplingParams(
        temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=3, max_tokens=4, stop=["x"],
        stop_token_ids=[1], ignore_eos=True, n=2, logprobs=None, logit_bias={},
        repetition_penalty=1.0, min_tokens=0,
    )  # fmt: skip


@pytest.mark.core
def test_the_core_alone_serves_offline(core_alone: None, model: str) -> None:
    """No step feature attaches; the base sampling parameters run (greedy, seeded sampling)."""
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_k=5, seed=1, max_tokens=4, ignore_eos=True)
    llm = LLM(model, page_size=4)
    try:
        assert llm.scheduler.features == []
        outs = llm.generate(
            [[1, 2, 3], [4, 5], [1, 2, 3]], [greedy, sampled, greedy], use_tqdm=False
        )
        assert [len(o["token_ids"]) for o in outs] == [4, 4, 4]
        assert outs[0]["token_ids"] == outs[2]["token_ids"]
    finally:
        llm.shutdown()
