"""`Lazy`: how an extension registers the parts that import torch, or fastapi."""

from __future__ import annotations

import importlib
from typing import Any


class Lazy:
    """A callable point's value named by module and attribute, imported at its first call: an
    extension registers its scheduler's parts so (those whose modules import torch), and the
    processes that load the registry but never call them (tokenizer, detokenizer, API) start
    without torch (issue 47); and its API process's parts (routes, metrics, the launcher:
    fastapi, prometheus_client), which the tokenizer, detokenizer and schedulers never call."""

    def __init__(self, module: str, name: str) -> None:
        self.module, self.name = module, name

    def resolve(self) -> Any:
        return getattr(importlib.import_module(self.module), self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"Lazy({self.module}.{self.name})"
