"""The structured extension (`minisgl/ext/structured`: tool calls and reasoning) and the core
without it (issue 46), in this process: the extension fills the `chat_features` point and checks
the parser options' names; with MINISGL_DISABLE_EXTENSIONS=1 the parser options, `LLM.chat` with
tools or parsers and the shell's reasoning display are refused, saying that they need the
structured extension, while a plain `LLM.chat` is served as before. The HTTP side:
tests/server/test_ext_structured_http.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from minisgl import LLM, SamplingParams, extension
from minisgl.extension import ExtensionMissing
from minisgl.server.args import ServerArgs
from minisgl.shell import Printer, make_printers
from minisgl.utils.options import OptionError
from support.server import make_tiny_model

NEEDS = "needs the structured extension (minisgl/ext/structured)"
CHAT = [{"role": "user", "content": "hello world"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LLM]:
    engine = LLM(make_tiny_model(str(tmp_path_factory.mktemp("tiny"))), page_size=4)
    yield engine
    engine.shutdown()


def test_the_extension_fills_its_point() -> None:
    assert extension.extensions().chat_features is not None
    ServerArgs(tool_call_parser="hermes", reasoning_parser="qwen3")


@pytest.mark.parametrize(
    ("name", "known"), [("tool_call_parser", "hermes"), ("reasoning_parser", "qwen3")]
)
def test_the_extension_checks_the_names(name: str, known: str) -> None:
    """The words argparse used when the options declared their choices."""
    with pytest.raises(OptionError) as info:
        ServerArgs(**{name: "nope"})
    assert info.value.name == name
    assert str(info.value).startswith("invalid choice: 'nope' (choose from ")
    assert known in str(info.value)


@pytest.mark.parametrize(
    ("name", "value"), [("tool_call_parser", "hermes"), ("reasoning_parser", "qwen3")]
)
def test_parser_options_need_the_extension(core_alone: None, name: str, value: str) -> None:
    with pytest.raises(OptionError) as info:
        ServerArgs(**{name: value})
    assert info.value.name == name
    assert str(info.value) == f"{value!r} {NEEDS}"
    ServerArgs()  # the core's own options stay


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"tools": TOOLS}, "tools"),
        ({"tools": TOOLS, "tool_choice": "none"}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_call_parser": "hermes"}, "tool_call_parser"),
        ({"reasoning_parser": "qwen3"}, "reasoning_parser"),
    ],
)
def test_offline_chat_refusals(
    core_alone: None, llm: LLM, options: dict[str, Any], what: str
) -> None:
    with pytest.raises(ExtensionMissing) as info:
        llm.chat([CHAT], GREEDY, use_tqdm=False, **options)
    assert str(info.value) == f"{what} {NEEDS}"


def test_plain_offline_chat_without_the_extension(core_alone: None, llm: LLM) -> None:
    """The chat as the template renders it, generated: the same as with the extension (which
    is not asked for anything here) and as `generate` on the rendered prompt."""
    (alone,) = llm.chat([CHAT], GREEDY, use_tqdm=False, tools=[])  # no tools: none asked
    (prompt,) = llm.generate([llm.apply_chat_template(CHAT)], GREEDY, use_tqdm=False)
    assert alone["token_ids"] == prompt["token_ids"] and len(alone["token_ids"]) == 4
    assert "content" not in alone and "tool_calls" not in alone


def test_plain_offline_chat_with_the_extension(llm: LLM) -> None:
    (plain,) = llm.chat([CHAT], GREEDY, use_tqdm=False)
    (prompt,) = llm.generate([llm.apply_chat_template(CHAT)], GREEDY, use_tqdm=False)
    assert plain["token_ids"] == prompt["token_ids"]


def test_shell_reasoning_needs_the_extension(core_alone: None) -> None:
    launcher: Any = SimpleNamespace(args=SimpleNamespace(reasoning_parser="qwen3"))
    with pytest.raises(ExtensionMissing) as info:
        make_printers(launcher)
    assert str(info.value) == f"--reasoning-parser {NEEDS}"


def test_shell_prints_the_text_without_a_parser(
    core_alone: None, capsys: pytest.CaptureFixture[str]
) -> None:
    launcher: Any = SimpleNamespace(args=SimpleNamespace(reasoning_parser=None))
    printer = make_printers(launcher)([{"role": "user", "content": "hi"}])
    assert type(printer) is Printer
    for piece in ("<think>", "a", "</think>", "b"):
        printer.feed(piece)
    printer.close()
    assert capsys.readouterr().out == "<think>a</think>b"  # no parser: the text as it is
    assert "".join(printer.answer) == "<think>a</think>b"
