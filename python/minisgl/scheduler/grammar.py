"""Structured generation with xgrammar: JSON schema, regex, EBNF and structural-tag constraints
(the last: tool calls for `tool_choice` required / named, and constraints after the reasoning).

A request's grammar is compiled on a worker thread as soon as the request arrives (compiled
grammars are cached by their text), so compilation overlaps with the wait and the prefill. Each
step that samples a constrained request fills that request's row of a token bitmask on the host
(xgrammar, several threads) and the engine applies it to the logits on the device (xgrammar's
kernel) before sampling, outside any CUDA graph. Requests without a grammar touch none of this.
`GrammarState` is all the scheduler sees of it.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from typing import TYPE_CHECKING, Any

import torch

from minisgl.core import Batch, Req, SamplingParams
from minisgl.engine.sample import TokenMask

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256  # compiled grammars kept (failures too: the same bad schema fails at once)
COMPILE_TIMEOUT_S = 30.0  # a request whose grammar takes longer fails instead of stalling all
TIMED_OUT = f"grammar compilation took longer than {COMPILE_TIMEOUT_S:.0f} s"


class GrammarError(ValueError):
    """A grammar that does not compile; the message is the compiler's."""


def grammar_key(params: SamplingParams) -> tuple[str, str] | None:
    """(kind, text) of the request's constraint, or None."""
    return params.constraint


def _clean(error: Exception) -> str:
    """xgrammar's C++ messages start with a timestamp, a source location and an assertion."""
    text = str(error).strip()
    text = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text)
    return re.sub(r"^Check failed: \(.*?\) is false: ", "", text)


class GrammarCompiler:
    """Compiles grammars off the scheduler's thread for one tokenizer and vocabulary. The
    xgrammar compiler itself is built by the first job (tokenizer analysis takes a while for
    large vocabularies), so a server whose clients never ask for a grammar never pays.
    `any_whitespace`: JSON schemas allow free whitespace between elements (default: compact
    separators, so a model cannot wander off into endless whitespace)."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = False,
    ) -> None:
        if tokenizer is None:
            raise GrammarError("this model has no tokenizer: constrained decoding needs one")
        self.tokenizer, self.vocab_size, self.stop_token_ids = tokenizer, vocab_size, stop_token_ids
        self.any_whitespace = any_whitespace
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self.cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self.lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, key: tuple[str, str]) -> Future:
        """A future of the compiled grammar (from the cache when this text was seen before)."""
        with self.lock:
            future = self.cache.get(key)
            if future is None:
                future = self.executor.submit(self._compile, *key)
                self.cache[key] = future
                while len(self.cache) > CACHE_SIZE:
                    self.cache.popitem(last=False)
            else:
                self.cache.move_to_end(key)
            return future

    def _compile(self, kind: str, text: str) -> xgrammar.CompiledGrammar:
        compiler = self._get_compiler()
        try:
            if kind == "json_schema":
                return compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            if kind == "regex":
                return compiler.compile_regex(text)
            if kind == "structural_tag":  # the format-dict form: {"type": "structural_tag", ...}
                return compiler.compile_structural_tag(text)
            return compiler.compile_grammar(text)
        except Exception as e:  # xgrammar raises RuntimeError, but no input may crash the server
            raise GrammarError(f"invalid {kind}: {_clean(e)}") from None

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        if self._compiler is None:
            import xgrammar as xgr

            info = self.tokenizer  # an xgrammar TokenizerInfo itself (benchmarks), or a HF one
            if not isinstance(info, xgr.TokenizerInfo):
                info = xgr.TokenizerInfo.from_huggingface(
                    info, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
                )
            self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return self._compiler

    def shutdown(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


class Constraint:
    """One request's grammar: the compile in progress, then the matcher that follows the
    tokens the request has generated."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher: xgrammar.GrammarMatcher | None = None
        # counted from the request's arrival, not from the step that first waits for it
        self.deadline = time.monotonic() + COMPILE_TIMEOUT_S

    def failure(self) -> str | None:
        """The compile error if compilation has ended with one, or has run past its deadline
        (does not wait): such a request is refused before it takes any place."""
        if self.future.done() and self.future.exception() is not None:
            return str(self.future.exception())
        if not self.future.done() and time.monotonic() > self.deadline:
            return TIMED_OUT
        return None

    def wait(self) -> xgrammar.GrammarMatcher:
        """The matcher, once the grammar is compiled; raises GrammarError if it did not."""
        if self.matcher is None:
            import xgrammar as xgr

            try:
                compiled = self.future.result(max(0.0, self.deadline - time.monotonic()))
            except TimeoutError:
                raise GrammarError(TIMED_OUT) from None
            self.matcher = xgr.GrammarMatcher(compiled)
        return self.matcher

    def accept(self, token: int) -> bool:
        return self.wait().accept_token(token)

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()


class GrammarState:
    """The scheduler's side of structured generation: the compiler and the token bitmask, each
    built on first use (a server whose clients never ask for a grammar never loads xgrammar),
    and the count of admitted constrained requests (0 skips every grammar check). The bitmask
    (host memory) is reused: a step with constraints waits for the previous one with
    constraints, so its copy is done by then. `any_whitespace`: GrammarCompiler's."""

    def __init__(
        self, vocab_size: int, max_rows: int, pin: bool, any_whitespace: bool = False
    ) -> None:
        self.vocab_size, self.max_rows, self.pin = vocab_size, max_rows, pin
        self.any_whitespace = any_whitespace
        self.compiler: GrammarCompiler | None = None
        self.bitmask: torch.Tensor | None = None
        self.filler: Any = None  # xgrammar.BatchGrammarMatcher: fills rows on several threads
        self.num_constrained = 0

    def constraint(
        self, params: SamplingParams, tokenizer: Any, stop_token_ids: set[int]
    ) -> Constraint | None:
        """The request's constraint, compiling on the worker thread from now on, or None."""
        key = grammar_key(params)
        if key is None:
            return None
        if self.compiler is None:
            self.compiler = GrammarCompiler(
                tokenizer, self.vocab_size, sorted(stop_token_ids), self.any_whitespace
            )
        return Constraint(self.compiler.compile(key))

    def applies(self, batch: Batch) -> bool:
        return self.num_constrained > 0 and any(r.grammar is not None for r in batch.reqs)

    def mask(
        self, reqs: list[Req], samples: list[bool]
    ) -> tuple[TokenMask | None, list[tuple[Req, str]]]:
        """The token bitmask of the requests that sample under a grammar (waiting for those
        still compiling), and (request, error) for each whose grammar failed."""
        matchers, rows, failed = [], [], []
        for i, (req, sampled) in enumerate(zip(reqs, samples)):
            if not sampled or req.grammar is None or req.finished:
                continue
            try:
                matchers.append(req.grammar.wait())
            except GrammarError as e:
                failed.append((req, str(e)))
                continue
            rows.append(i)
        if not rows:
            return None, failed
        if self.bitmask is None:
            import xgrammar as xgr

            shape = xgr.get_bitmask_shape(self.max_rows, self.vocab_size)
            self.bitmask = torch.empty(shape, dtype=xgr.bitmask_dtype, pin_memory=self.pin)
            self.filler = xgr.BatchGrammarMatcher()
        bitmask = self.bitmask[: len(reqs)]
        self.filler.batch_fill_next_token_bitmask(matchers, bitmask, rows)
        return TokenMask(bitmask, rows), failed

    def shutdown(self) -> None:
        if self.compiler is not None:
            self.compiler.shutdown()
