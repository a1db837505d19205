"""A Hugging Face model directory's config, tokenizer and end-of-sequence ids (not weights)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable
from typing import Any

from minisgl.extension import extensions
from minisgl.models.config import token_ids


def transformers_without_torch() -> None:
    """Import transformers as if torch were absent (else it imports torch: ~2 s and ~190 MB a
    process, issues 47 and 51), first thing in a process that runs none of its models: the
    launcher's children (the schedulers run minisgl's), the launcher once its models are resolved.
    Its models are then unavailable, torch stays importable; a no-op once either is imported."""
    if "transformers" in sys.modules or "torch" in sys.modules:
        return
    if (before := extensions().before_transformers) is not None:
        before()
    quiet = "TRANSFORMERS_NO_ADVISORY_WARNINGS"  # its notice that models are unavailable
    was = os.environ.get(quiet)
    sys.modules["torch"] = None  # type: ignore[assignment]  # find_spec and import: no torch
    os.environ[quiet] = "1"
    try:
        import transformers  # noqa: F401  (decides once whether torch is there)
        from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (their modules too)
    finally:
        del sys.modules["torch"]
        if was is None:
            del os.environ[quiet]
        else:
            os.environ[quiet] = was


def load_hf_config(model_path: str) -> Any:  # transformers.PretrainedConfig
    from transformers import AutoConfig

    if not os.path.exists(os.path.join(model_path, "config.json")):
        raise ValueError(f"missing config.json in model directory {model_path!r}")
    return AutoConfig.from_pretrained(model_path)


def load_tokenizer(model_path: str) -> Any | None:
    """The model's tokenizer, or None when the directory has none (e.g. dummy-weight configs)."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    if not any(os.path.exists(os.path.join(model_path, n)) for n in names):
        return None
    return AutoTokenizer.from_pretrained(model_path)


def eos_token_ids(model_path: str, config_ids: Iterable[int], tokenizer: Any | None) -> set[int]:
    """EOS ids from the model config (`config_ids`), generation_config.json and the tokenizer."""
    ids = set(config_ids)
    with contextlib.suppress(OSError):  # no generation_config.json
        from transformers import GenerationConfig

        ids.update(token_ids(GenerationConfig.from_pretrained(model_path).eos_token_id))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
