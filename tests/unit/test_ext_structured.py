"""The structured extension (`minisgl/ext/structured`: tool calls and reasoning) and the core
without it (issue 46), in this process: the extension fills the `chat_features` point and owns
the parser flags (the `options` point), checking their names; with MINISGL_DISABLE_EXTENSIONS=1
the parser flags, `LLM.chat` with tools or parsers and the shell's reasoning display are
refused, saying that they need the structured extension, while a plain `LLM.chat` and the
shell's plain printing are served as before. The HTTP side:
tests/server/test_ext_structured_http.py."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from minisgl import LLM, SamplingParams, extension
from minisgl.extension import ExtensionMissing
from minisgl.server.args import ServerArgs, parse_args
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


def chat_args(**options: Any) -> ServerArgs:
    """ServerArgs with the structured extension's options `options` (checked)."""
    from minisgl.ext.structured.options import ChatOptions

    return ServerArgs(extras={"structured": ChatOptions(**options)})


def test_the_extension_fills_its_point() -> None:
    from minisgl.ext.structured.options import chat_options

    assert extension.extensions().chat_features is not None
    args = parse_args(["--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"])
    options = chat_options(args)
    assert (options.tool_call_parser, options.reasoning_parser) == ("hermes", "qwen3")


@pytest.mark.parametrize(
    ("name", "known"), [("tool_call_parser", "hermes"), ("reasoning_parser", "qwen3")]
)
def test_the_extension_checks_the_names(name: str, known: str) -> None:
    """The words argparse used when the options declared their choices."""
    with pytest.raises(OptionError) as info:
        chat_args(**{name: "nope"})
    assert info.value.name == name
    assert str(info.value).startswith("invalid choice: 'nope' (choose from ")
    assert known in str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["--tool-call-parser", "hermes"],
        ["--reasoning-parser", "qwen3"],
        ["--shell", "--shell-hide-reasoning"],
    ],
)
def test_parser_options_need_the_extension(
    core_alone: None, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    flag = argv[-1] if argv[-1].startswith("--") else argv[0]
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2
    assert f"error: {flag} {NEEDS}" in capsys.readouterr().err
    assert ServerArgs().extras == {}  # the core's own options stay


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


def test_shell_reasoning_needs_the_extension(
    core_alone: None, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--shell", "--reasoning-parser", "qwen3"])
    assert f"error: --reasoning-parser {NEEDS}" in capsys.readouterr().err


@pytest.mark.parametrize("alone", [True, False])
def test_shell_prints_the_text_without_a_parser(
    alone: bool, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    """The core alone, or the extension with --reasoning-parser none: the core's printer."""
    if alone:
        request.getfixturevalue("core_alone")
    args = ServerArgs() if alone else chat_args(reasoning_parser="none")
    launcher: Any = SimpleNamespace(args=args)
    printer = make_printers(launcher)([{"role": "user", "content": "hi"}])
    assert type(printer) is Printer
    for piece in ("<think>", "a", "</think>", "b"):
        printer.feed(piece)
    printer.close()
    assert capsys.readouterr().out == "<think>a</think>b"  # no parser: the text as it is
    assert "".join(printer.answer) == "<think>a</think>b"
