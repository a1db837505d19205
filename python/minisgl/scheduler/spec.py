"""Speculative decoding, the scheduler's side: which tokens a request proposes for the next step
(`NgramProposer`, prompt lookup) and which of them the target model accepts (`accept`).

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

from minisgl.core import Req

NGRAM_WINDOW = 4096  # the latest tokens of a request searched for a match


def can_speculate(req: Req) -> bool:
    p = req.params
    return req.grammar is None and not p.adjusts_logits and p.logprobs is None


class NgramProposer:
    """Prompt lookup: for n from `max_n` down to `min_n`, the latest earlier occurrence of the
    request's last n tokens within its last NGRAM_WINDOW tokens; the tokens that followed it
    are the proposal (up to `num_draft`)."""

    def __init__(self, num_draft: int, min_n: int, max_n: int) -> None:
        self.num_draft, self.min_n, self.max_n = num_draft, min_n, max_n

    def propose(self, req: Req) -> list[int]:
        """Proposals for the tokens after req.tokens, never past its max_tokens or context (the
        step's own sampled token comes after them)."""
        room = min(
            self.num_draft,
            req.params.max_tokens - req.num_output - 1,
            req.max_total_len - len(req.tokens) - 1,
        )
        if room <= 0 or not can_speculate(req):
            return []
        tokens = req.tokens[-NGRAM_WINDOW:]
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            found = latest_match(tokens, n)
            if found is not None:
                return tokens[found : found + room]
        return []


def latest_match(tokens: list[int], n: int) -> int | None:
    """The end of the latest occurrence of tokens[-n:] that ends before the last token (so a
    continuation exists), or None."""
    suffix, first = tokens[-n:], tokens[-n]
    for start in range(len(tokens) - n - 1, -1, -1):
        if tokens[start] == first and tokens[start : start + n] == suffix:
            return start + n
    return None


def accept(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens a verified step adds: the proposals up to the first the target disagrees
    with, then the target's own token there (targets[j]: the target's token after drafts[:j])."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return drafts[:n] + [targets[n]]
