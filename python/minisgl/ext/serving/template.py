"""--chat-template (vLLM's flag): a chat template replacing the tokenizer's, for the tokenizer
workers (the launcher's `tokenizer_worker`), the API process's tokenizer and the shell's."""

from __future__ import annotations

import os
from typing import Any

from minisgl.utils.options import OptionError


def read_chat_template(value: str) -> str:
    """--chat-template's text: a file's, or the value itself when it looks like a template
    (vLLM's rule: it holds a brace or a newline); a path that does not exist is refused."""
    if os.path.isfile(value):
        try:
            with open(value) as f:
                return f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise OptionError("chat_template", f"cannot read {value!r}: {e}") from None
    if os.path.isdir(value):
        raise OptionError("chat_template", f"{value!r} is a directory, not a template file")
    if not any(c in value for c in "{}\n"):
        raise OptionError("chat_template", f"no such file {value!r}, and no template tags in it")
    return value


def with_chat_template(tokenizer: Any | None, chat_template: str | None) -> Any | None:
    """`tokenizer` (None: the model has none) with --chat-template's template, when given."""
    if tokenizer is not None and chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def load_chat_tokenizer(model_path: str, chat_template: str | None) -> Any | None:
    """The model's tokenizer (None: it has none) with --chat-template applied."""
    from minisgl.models.hf import load_tokenizer

    return with_chat_template(load_tokenizer(model_path), chat_template)
