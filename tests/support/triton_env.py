"""Triton kernels in tests: compiled on CUDA, else run by Triton's CPU interpreter. The
interpreter is chosen when a kernel is decorated, and triton's own library is decorated at
import, so TRITON_INTERPRET must be set before anything imports triton: a test module calls
`use_interpreter_on_cpu()` at import (nothing imports triton during collection)."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest
import torch

CUDA = torch.cuda.is_available()


def use_interpreter_on_cpu() -> bool:
    """Set TRITON_INTERPRET=1 on a machine without CUDA if it can still take effect."""
    interpretable = not CUDA and (
        "triton" not in sys.modules or os.environ.get("TRITON_INTERPRET") == "1"
    )
    if interpretable:
        os.environ["TRITON_INTERPRET"] = "1"
    return interpretable


def kernel_module(name: str) -> ModuleType:
    """minisgl.kernel.<name> (the module `name` when dotted: an extension's), or a skip where
    triton is missing or cannot be interpreted."""
    pytest.importorskip("triton")
    if not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported before TRITON_INTERPRET could be set")
    return importlib.import_module(name if "." in name else f"minisgl.kernel.{name}")
