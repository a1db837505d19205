"""JSON-constrained output is compact by default (a model cannot pad with whitespace until
max_tokens); `--json-any-whitespace` (SchedulerConfig.extras["structured"]) lets whitespace
between JSON elements through. Checked on the compiled grammars themselves, on the
`response_format: json_object` path, on the flag, and end to end with the offline LLM."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from minisgl import LLM, SamplingParams
from minisgl.ext.structured.fields import ConstraintFields
from minisgl.ext.structured.grammar import GrammarState
from minisgl.scheduler.config import SchedulerConfig
from minisgl.server.args import parse_args
from support.server import make_tiny_model
from support.tokenizer import build_tiny_tokenizer

VOCAB = 512  # the tiny model's (support/models.py)
OBJECT = '{"type": "object"}'
# (a schema, text it has accepted, whitespace that compact JSON refuses next)
REFUSED_WHEN_COMPACT = [
    (OBJECT, "{", " "),
    (OBJECT, "{", "\n"),
    (OBJECT, '{"a": 1, ', " "),  # after xgrammar's one-space separators
    (OBJECT, '{"a": ', "\n"),
    ('{"type": "array"}', "[", "\n"),
]


@pytest.fixture(scope="module")
def tokenizer():
    return build_tiny_tokenizer()


def matcher(tokenizer, any_whitespace: bool, params: SamplingParams):
    state = GrammarState(VOCAB, 4, pin=False, any_whitespace=any_whitespace)
    constraint = state.constraint(params, tokenizer, {tokenizer.eos_token_id})
    assert constraint is not None
    try:
        return constraint.wait()
    finally:
        state.shutdown()


def token_of(tokenizer, text: str) -> int:
    (token,) = tokenizer.encode(text)  # one byte-level token each
    return token


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_whitespace_between_json_elements(tokenizer, any_whitespace: bool) -> None:
    # what the server makes of response_format {"type": "json_object"}: the same JSON path
    fields = ConstraintFields.model_validate({"response_format": {"type": "json_object"}})
    json_object = SamplingParams(**fields.params(None))
    assert json_object.get("json_schema") == OBJECT
    for schema, accepted, space in REFUSED_WHEN_COMPACT:
        m = matcher(tokenizer, any_whitespace, SamplingParams(json_schema=schema))
        assert m.accept_string(accepted), accepted
        assert m.accept_token(token_of(tokenizer, space)) == any_whitespace, (accepted, space)
    # compact still means xgrammar's one-space separators: `{"a": 1, "b": 2}`
    m = matcher(tokenizer, any_whitespace, json_object)
    assert m.accept_string('{"a": 1, "b": 2}') and m.is_terminated() is False
    assert m.accept_token(tokenizer.eos_token_id) and m.is_terminated()


def test_the_flag() -> None:
    assert SchedulerConfig().extras["structured"].json_any_whitespace is False
    assert parse_args(["--model", "m"]).scheduler.extras["structured"].json_any_whitespace is False
    args = parse_args(["--model", "m", "--json-any-whitespace"])
    assert args.scheduler.extras["structured"].json_any_whitespace
    with pytest.raises(SystemExit):  # a flag, not an option with a value
        parse_args(["--model", "m", "--json-any-whitespace", "yes"])


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    yield make_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen3")))


@pytest.mark.parametrize("any_whitespace", [False, True])
def test_offline_llm_pads_with_whitespace_only_when_allowed(
    model_dir: str, tokenizer, any_whitespace: bool
) -> None:
    """A model that wants nothing but newlines (logit_bias): compact JSON gives it none, free
    whitespace lets it pad until max_tokens, which is why compact is the default."""
    newline = token_of(tokenizer, "\n")
    llm = LLM(model_dir, page_size=4, json_any_whitespace=any_whitespace)
    try:
        params = SamplingParams(json_schema=OBJECT, max_tokens=8, logit_bias={newline: 100.0})
        (out,) = llm.generate(["the cat"], params, use_tqdm=False)
    finally:
        llm.shutdown()
    if any_whitespace:
        assert out["token_ids"] == [token_of(tokenizer, "{")] + [newline] * 7, out
    else:
        assert newline not in out["token_ids"] and out["text"].startswith("{"), out
