"""Speculative decoding, the scheduler's side (a `Speculator`, through the `step_features`
point): which running requests propose in a step (`Backoff`), their proposals (proposers.py),
and which of them the target model accepts (`accept_run`).

A request with K proposals computes 1 + K tokens in one forward (its last token and the
proposals, an extend over its paged KV); the engine samples the target's token at each of those
positions exactly as a plain decode step would sample it there (the same logits, the same
per-(seed, position) noise, so greedy is the argmax and sampling draws the same token), and a
proposal is accepted while it equals the target's token. The output is token for token what
decoding without speculation gives, for greedy and seeded sampling alike; a deterministic
proposal d is accepted with the target's probability p(d), as in rejection sampling against a
one-hot draft. Requests whose logits are adjusted (penalties, logit_bias, min_tokens), masked
(grammars) or that ask for logprobs decode without proposals."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

from minisgl.core import Req
from minisgl.ext.spec.options import spec_options
from minisgl.ext.spec.proposers import DraftModelProposer, NgramProposer, room
from minisgl.ext.spec.verify import RESULT, Verification
from minisgl.extension import Speculator

Proposer = NgramProposer | DraftModelProposer


@dataclass
class SpecState:
    """One request's speculation: the proposals of the step planned last, its back-off, its
    counts (offline results)."""

    drafts: list[int] = field(default_factory=list)
    backoff: int = 0  # > 1: it proposes in every backoff-th step only
    drafted: int = 0
    accepted: int = 0


class Backoff:
    """Adaptive speculation: a request whose proposals gained nothing (none found, or none
    accepted) proposes only every 2nd, then 4th, 8th, ... decode step, up to every
    `max_steps`-th, and at every step again once one is accepted. A step has to wait for the
    step in flight before it can propose (the proposals continue its tokens), so only steps in
    which nobody proposes keep overlap scheduling: this bounds what proposals that never pay
    cost. The steps are counted on one clock, so requests that back off alike propose in the
    same steps and a batch keeps the steps between overlapped."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.clock = 0  # decode steps planned so far

    def due(self, req: Req, state: SpecState, num_draft: int) -> bool:
        """Whether the request proposes in the next decode step."""
        every = state.backoff
        return (every <= 1 or self.clock % every == 0) and room(req, num_draft) > 0

    def tick(self) -> None:
        """A decode step was planned."""
        self.clock += 1

    def result(self, state: SpecState, gained: bool) -> None:
        """A step it proposed in (or was due to and found nothing): whether a proposal was
        accepted."""
        state.backoff = 0 if gained else min(max(2, 2 * state.backoff), self.max_steps)


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified step adds: the proposals up to the first the target disagrees
    with, then the target's own token there (targets[j]: the target's token after drafts[:j])."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return drafts[:n] + [targets[n]]


class Speculation(Speculator):
    """--speculative-algorithm's speculation over a `proposer`. Each request's state lives as
    long as its Req (a weak key): the offline result reads its counts after it ends."""

    name = RESULT

    def __init__(self, scheduler: Any, proposer: Proposer, max_backoff: int) -> None:
        self.scheduler, self.proposer = scheduler, proposer
        self.backoff = Backoff(max_backoff)
        self.states: WeakKeyDictionary[Req, SpecState] = WeakKeyDictionary()
        self.reset_counts()

    def state(self, req: Req) -> SpecState:
        if (state := self.states.get(req)) is None:
            state = self.states[req] = SpecState()
        return state

    def _due(self, running: list[Req]) -> list[Req]:
        num_draft = self.proposer.num_draft
        return [r for r in running if self.backoff.due(r, self.state(r), num_draft)]

    def before_step(self) -> None:
        """A step that proposes waits for the step in flight: the proposals continue its tokens."""
        sched = self.scheduler
        if sched.in_flight is not None and self._due(sched.planner.running):
            sched._read_in_flight()

    def propose(self, planner: Any, decodes: list[Req]) -> None:
        """Proposals of the requests due, each into the step where pages are left for them (in
        the token table past the request's tokens); a due request that finds none backs off."""
        due = self._due(decodes)
        self.backoff.tick()
        proposals = self.proposer.propose_all(due) if due else {}
        for req in due:
            drafts = self.state(req).drafts = proposals.get(req.uid, [])
            if not drafts:
                self.backoff.result(self.state(req), gained=False)
            elif planner.grow(req, 1 + len(drafts)):
                planner.engine.set_tokens(req.table_idx, drafts, start=len(req.tokens))
                req.extend_len = 1 + len(drafts)

    def accept_run(self, engine: Any, req: Req, slot: int, targets: list[int]) -> list[int]:
        """The row computed its last token and len(targets) - 1 of its proposals; the token at
        `slot` is the placeholder of the first. The KV of the rejected ones is dropped, and the
        last token of the run, which the next step reads, goes into the token table."""
        state = self.state(req)
        drafts, state.drafts = state.drafts[: len(targets) - 1], []
        new = accept(drafts, targets)
        req.cached_len -= len(targets) - len(new)
        engine.set_tokens(req.table_idx, new[-1:], start=slot + len(new) - 1)
        del req.tokens[slot:]  # the placeholder
        self.backoff.result(state, gained=len(new) > 1)
        state.drafted += len(drafts)
        state.accepted += len(new) - 1
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(new) - 1
        self.num_verified_rows += 1
        return new

    def read(self, reqs: list[Req], result: Verification) -> list[list[int] | None]:
        """Per batch row, the target's token at each of its positions if it verified."""
        by_row = result.by_row()
        return [by_row.get(i) for i in range(len(reqs))]

    def result(self, req: Req, outputs: list[Any] | None = None) -> dict[str, Any]:
        state = self.state(req)
        return {"num_draft_tokens": state.drafted, "num_accepted_tokens": state.accepted}

    def counts(self) -> dict[str, int]:
        return {
            "spec_draft_tokens": self.num_draft_tokens,  # proposals verified
            "spec_accepted_tokens": self.num_accepted_tokens,  # of those, accepted
            "spec_verified_rows": self.num_verified_rows,  # request-steps that verified
        }

    def reset_counts(self) -> None:
        self.num_draft_tokens = self.num_accepted_tokens = self.num_verified_rows = 0

    def release(self, req: Req) -> None:
        self.state(req).drafts = []
        self.proposer.release(req)

    def shutdown(self) -> None:
        self.proposer.shutdown()


def make_speculation(scheduler: Any) -> Speculation | None:
    """--speculative-algorithm's speculation for a scheduler's engine (None: off)."""
    options = spec_options(scheduler.config)
    k = options.speculative_num_draft_tokens
    proposer: Proposer
    if options.speculative_algorithm == "ngram":
        low = options.speculative_ngram_min_match_window_size
        proposer = NgramProposer(k, low, options.speculative_ngram_max_match_window_size)
    elif options.speculative_algorithm == "standalone":
        assert options.speculative_draft_model_path is not None  # SpecOptions checks it
        proposer = DraftModelProposer(scheduler.engine, k, options.speculative_draft_model_path)
    else:
        return None
    return Speculation(scheduler, proposer, options.speculative_max_backoff)
