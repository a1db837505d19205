"""The detokenizer's part of the sampling features (the `detokenize` point): min_tokens' rule
for stop strings, and the text of each token in the log-probability entries.

min_tokens (vLLM's semantics): a stop string counts only if it ends in the text of a token after
the first min_tokens (one straddling the boundary counts, cut where it starts). Text belongs to
the token after which it decodes, as in vLLM: one that ends mid-character passes all its text on
to the token that completes the character (" 你" as " " + two bytes, then the last byte: the
space belongs to the second token).
"""

from __future__ import annotations

from typing import Any

from minisgl.message import DetokenizeMsg, UserReply
from minisgl.tokenizer.detokenize import IncrementalDetokenizer


class MinTokensDetokenizer(IncrementalDetokenizer):
    """An `IncrementalDetokenizer` whose stop strings count only past the first min_tokens."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], skip: bool, stop: list[str], min_tokens: int
    ) -> None:
        super().__init__(tokenizer, prompt_ids, skip, stop)
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens fed so far
        self._protected = 0  # _pending[:_protected] is text of the first min_tokens tokens
        # characters at the start of the next delta that the first min_tokens tokens decoded,
        # when the min_tokens-th token ended inside a character (so nothing was emitted then):
        # the text up to the last of them that did not end mid-character
        self._early = 0

    def _complete_len(self) -> int:
        """Length of the decode of the longest run of the window's ids that does not end
        mid-character: what per-token decoding (vLLM's) has emitted by now (a token that ends
        mid-character emits nothing, not even the characters it completes before that)."""
        for n in range(len(self._ids) - 1, self._read, -1):
            text = self._decode(self._ids[:n])
            if not text.endswith("\ufffd"):
                return len(text)
        return len(self._prefix_text)

    def add(self, token_ids: list[int]) -> str:
        if self.stopped or not token_ids:
            return ""
        boundary = self.min_tokens - self._num_tokens
        if 0 < boundary < len(token_ids):  # the text of the first min_tokens is checked apart
            return self.add(token_ids[:boundary]) + self.add(token_ids[boundary:])
        self._num_tokens += len(token_ids)
        delta = super().add(token_ids)
        # ids past the read mark: the last token ended mid-character (the window did not slide)
        if self._num_tokens == self.min_tokens and len(self._ids) > self._read:
            self._early = self._complete_len() - len(self._prefix_text)
        return delta

    def _check_stop(self, delta: str, final: bool, after: int = 0) -> str:
        size = len(self._pending) + len(delta)
        early, self._early = self._early, 0
        protected = size if self._num_tokens <= self.min_tokens else self._protected + early
        delta = super()._check_stop(delta, final, protected)
        # what stays held of the protected text (the rest was emitted)
        self._protected = max(0, protected - (size - len(self._pending)))
        return delta


def token_texts(tokenizer: Any | None, ids: list[int]) -> list[str]:
    """Each token's own text (special tokens included), as log-probability entries show it;
    without a tokenizer, vLLM's `token_id:N`."""
    if tokenizer is None:
        return [f"token_id:{i}" for i in ids]
    return tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False)


def named_logprobs(tokenizer: Any | None, entries: list[list[Any]]) -> list[list[Any]]:
    """[token id, logprob, top ids, top logprobs] entries -> [token id, text, logprob,
    [[id, text, logprob], ...]] (one batched decode for all of them)."""
    ids = [i for e in entries for i in (e[0], *e[2])]
    texts = iter(token_texts(tokenizer, ids))
    named = []
    for token, logprob, top_ids, top_logprobs in entries:
        text = next(texts)
        top = [[i, next(texts), lp] for i, lp in zip(top_ids, top_logprobs)]
        named.append([token, text, logprob, top])
    return named


class SamplingDetokenize:
    """The `detokenize` point (`extension.DetokenizeFeatures`)."""

    def detokenizer(
        self, tokenizer: Any, prompt_ids: list[int], skip: bool, stop: list[str], min_tokens: int
    ) -> MinTokensDetokenizer:
        return MinTokensDetokenizer(tokenizer, prompt_ids, skip, stop, min_tokens)

    def name_logprobs(self, tokenizer: Any, msg: DetokenizeMsg, reply: UserReply) -> None:
        """The message's `logprob` (of its token: [logprob, top ids, top logprobs]) and
        `prompt_logprobs` ([token id, logprob | None, top ids, top logprobs] per prompt token)
        as the reply's `logprobs` and `prompt_logprobs`: [token id, text, logprob, [[id, text,
        logprob], ...]] per token."""
        if (entry := msg.ext.get("logprob")) is not None:
            entries = [[t, *entry] for t in msg.token_ids]
            reply.ext["logprobs"] = named_logprobs(tokenizer, entries)
        if (prompt := msg.ext.get("prompt_logprobs")) is not None:
            reply.ext["prompt_logprobs"] = named_logprobs(tokenizer, prompt)
