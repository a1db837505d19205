"""The API process's own copy of the workers' tokenizer (their files and --chat-template),
loaded on first use, for the extensions' work that needs one in that process: /tokenize,
/v1/models' vocab_size, a tool format's vocabulary, an echoed prompt's text..."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from minisgl.ext.serving.options import serving_options
from minisgl.ext.serving.template import load_chat_tokenizer
from minisgl.server.protocol import APIError
from minisgl.utils.procs import freeze_startup_heap

T = TypeVar("T")

_lock = threading.Lock()
_loaded: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # ApiServer -> it


async def with_tokenizer(api: Any, work: Callable[[Any], T], param: str) -> T:
    """`work(tokenizer)` in a thread, with `api`'s (the core's ApiServer) tokenizer loaded once
    (its objects then join the frozen heap); its failure is the client's (400 naming `param`)."""

    def run() -> T:
        with _lock:
            if api not in _loaded:
                from minisgl.models.weight import resolve_model_path

                path = resolve_model_path(api.args.engine.model or "")
                _loaded[api] = load_chat_tokenizer(path, serving_options(api.args).chat_template)
                freeze_startup_heap()
        return work(_loaded[api])

    try:
        return await asyncio.get_running_loop().run_in_executor(None, run)
    except Exception as e:
        raise APIError(400, str(e), param) from None
