"""`LLM(dp=N)` (the `replicas` point): the LLM whose prompts go to N replica processes
(`replicas.Replicas`), each chosen by the server's --dp dispatcher; it holds only the tokenizer."""

from __future__ import annotations

import atexit
from collections.abc import Sequence
from typing import Any

from minisgl.core import SamplingParams
from minisgl.ext.serving.dispatch import Dispatcher
from minisgl.ext.serving.replicas import Replicas
from minisgl.llm.llm import LLM
from minisgl.models.hf import load_tokenizer
from minisgl.models.weight import default_model, resolve_model_path


class ReplicatedLLM(LLM):
    """`LLM` with `dp`, `dp_dispatch` (as --dp-dispatch) and `dp_load_threshold`; dp=1 runs as
    the plain LLM, its dispatch options checked all the same."""

    replicas: Replicas | None = None

    def __init__(
        self,
        model: str | None = None,
        *,
        tp: int = 1,
        dp: int = 1,
        dp_dispatch: str = "prefix",
        dp_load_threshold: int = 8,
        **options: Any,
    ) -> None:
        if not isinstance(dp, int) or dp < 1:
            raise ValueError(f"LLM(dp={dp!r}): the number of replicas must be an int >= 1")
        model = model or default_model()
        config, self.sched_config = self.configs(model, options)  # bad options fail here
        dispatcher = Dispatcher(dp, config.page_size, dp_dispatch, dp_load_threshold)
        if dp == 1:
            super().__init__(model, tp=tp, **options)
            return
        path = resolve_model_path(model)  # download once, before the replicas
        self.tokenizer = load_tokenizer(path)
        self.replicas = Replicas(LLM, path, tp, dp, options, dispatcher)
        atexit.register(self.shutdown)

    def _generate(
        self, prompts: list[list[int]], params: Sequence[SamplingParams], use_tqdm: bool
    ) -> list[dict[str, Any]]:
        if self.replicas is None:
            return super()._generate(prompts, params, use_tqdm)
        return self.replicas.generate(prompts, params, use_tqdm)

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens found in the prefix cache so far (all replicas')."""
        if self.replicas is None:
            return super().num_cached_tokens
        return sum(self.replicas.call_all("num_cached_tokens"))

    def reset_prefix_cache(self) -> None:
        """Forget every replica's cached prefixes."""
        if self.replicas is None:
            return super().reset_prefix_cache()
        self.replicas.call_all("reset_prefix_cache")

    def shutdown(self) -> None:
        if self.replicas is None:
            return super().shutdown()
        atexit.unregister(self.shutdown)
        self.replicas.shutdown()
