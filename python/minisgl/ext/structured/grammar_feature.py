"""Grammars as a step feature of the scheduler: a constrained request (json_schema, regex, ebnf
or structural_tag) holds its `Constraint` in `req.ext["grammar"]`, waits in the scheduler's
`held` list while its grammar compiles (ext/held.py: TP rank 0 decides when it is admitted), has
its logits
masked by the grammar (stage 0: before the sampling extension's adjustments) and ends when
its matcher refuses a token or terminates. The compile workers are `grammar.py`'s."""

from __future__ import annotations

import json
from typing import Any

from minisgl.core import CONSTRAINT_KINDS, Batch, Req, SamplingParams
from minisgl.ext.held import Holding
from minisgl.ext.structured.grammar import (
    GRAMMAR,
    Constraint,
    GrammarState,
    TokenMask,
    apply_token_bitmask,
)
from minisgl.ext.structured.options import structured_options


def check_constraint(p: SamplingParams) -> None:
    """At most one constraint, given as text (a dict json_schema / structural_tag becomes its
    JSON text, key order kept: it travels in messages)."""
    for name in ("json_schema", "structural_tag"):
        value = p.get(name)
        if isinstance(value, dict):
            try:
                p.ext[name] = json.dumps(value)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{name} is not JSON: {e}") from None
    given = [name for name in CONSTRAINT_KINDS if p.get(name) is not None]
    if len(given) > 1:
        kinds = ", ".join(CONSTRAINT_KINDS[:-1]) + " and " + CONSTRAINT_KINDS[-1]
        raise ValueError(f"give at most one of {kinds}, got {given}")
    if given and not isinstance(p.get(given[0]), str):
        raise ValueError(f"{given[0]} must be a string")


class GrammarFeature(Holding):
    """The scheduler's grammars: a `GrammarState` over the requests held while compiling."""

    name, stage, changes_logits, needs_tokens = GRAMMAR, 0, True, True

    def __init__(self, scheduler: Any) -> None:
        super().__init__(scheduler)  # its tokenizer at each request (a benchmark swaps it in)
        engine, options = scheduler.engine, structured_options(scheduler.config)
        self.state = GrammarState(
            engine.model_config.vocab_size,
            engine.config.max_running_requests,
            engine.device.type == "cuda",
            options.json_any_whitespace,
            options.grammar_compile_timeout,
            leads=not scheduler.follower,
        )
        self.state.compiling = self.held  # the held requests are those compiling
        self.counted: set[int] = set()  # uids of the constrained requests added, not ended

    def request(self, req: Req) -> None:
        sched = self.scheduler
        constraint = self.state.constraint(req.params, sched.tokenizer, sched.eos_token_ids)
        if constraint is not None:
            req.ext[self.name] = constraint

    def holds(self, req: Req) -> bool:
        self.counted.add(req.uid)
        self.state.num_constrained = len(self.counted)
        return super().holds(req)

    def poll(self, held: list[Req]) -> tuple[list[Req], list[tuple[Req, str]]]:
        return self.state.poll()

    def settle(self, req: Req) -> None:
        req.ext[self.name].wait()  # raises GrammarError (a ValueError) for a bad grammar

    def finished(self, req: Req) -> None:
        super().finished(req)
        self.counted.discard(req.uid)
        self.state.num_constrained = len(self.counted)

    def shutdown(self) -> None:
        self.state.shutdown()

    def prepare(self, batch: Batch, samples: list[bool]) -> TokenMask | None:
        return self.state.mask(batch.reqs, samples)

    def process(self, engine: Any, batch: Batch, out: Any, prepared: Any, masked: bool) -> bool:
        if prepared is None:
            return False
        apply_token_bitmask(out.logits, prepared)
        return True

    def accept(self, req: Req, token: int, reason: str | None) -> tuple[str | None, str | None]:
        grammar: Constraint = req.ext[self.name]
        if not grammar.accept(token):  # the mask allows only tokens it accepts
            return "error", f"token {token} does not match the grammar"
        if reason is None and grammar.terminated:
            return "stop", None
        return reason, None


def grammar_state(scheduler: Any) -> GrammarState:
    """A scheduler's grammar state (tests, tools)."""
    return next(f.state for f in scheduler.features if isinstance(f, GrammarFeature))


def constraint_of(req: Req) -> Constraint | None:
    """A request's grammar, or None."""
    return req.ext.get(GRAMMAR)
