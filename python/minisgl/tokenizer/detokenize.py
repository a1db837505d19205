"""Incremental detokenization: token ids in, finalised text deltas out.

Two layers of holding back:
1. UTF-8: a token may end inside a multi-byte character, which decodes to a trailing "\ufffd".
   Such tokens wait until a later token completes the character. Each step decodes only a
   window of recent tokens (prefix..end) and diffs it against the decode of prefix..read, so the
   work per token is O(window), and tokenizers that treat the first token specially (leading
   spaces) see the same context in both decodes.
2. Stop strings: finalised text that could be the start of a stop string waits until it is
   either completed (generation stops, the stop string is cut off) or ruled out.

min_tokens (vLLM's semantics): a stop string cannot end the output before min_tokens tokens.
A stop string counts only if it ends in the text of a token after the first min_tokens; one that
starts earlier and ends there (it straddles the boundary) counts, and the output is cut where it
starts, as vLLM's search window does. Text belongs to the token after which it decodes, as in
vLLM's detokenizer: one that ends mid-character passes all its text on to the token that
completes the character, even characters it completes itself before that (" 你" split as
" " + two bytes, then the last byte: the space belongs to the second token).
"""

from __future__ import annotations

from typing import Any

# Prompt tokens decoded in front of the output so the first output tokens are decoded in context.
_PROMPT_CONTEXT = 5


def partial_suffix(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest end of `text` that is a proper beginning of one of `tags`: text
    that may still become a tag (here a stop string) and must be withheld until it is clearly
    not one."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def find_stop(text: str, stops: list[str], after: int = 0) -> tuple[int, str] | None:
    """The stop string that completes first, past text[:after], when `text` is read left to
    right (on a tie, the one that starts earlier): (index where it starts, the stop string), or
    None."""
    best: tuple[int, int, str] | None = None  # (end, start, stop)
    for s in stops:
        i = text.find(s, max(0, after - len(s) + 1))  # ends past `after`
        if i >= 0 and (best is None or (i + len(s), i) < best[:2]):
            best = (i + len(s), i, s)
    return None if best is None else (best[1], best[2])


class IncrementalDetokenizer:
    """Turns a request's output tokens into text deltas that are never broken UTF-8 and never
    show part of a stop string.

    The concatenation of every `add` result and `finish()` equals the decode of all output ids
    (for byte-level tokenizers, and prompt context aside), cut before the first stop string to
    complete. After a stop string, `stopped` is True, `stop_reason` is that string and further
    calls return ""."""

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: list[int] | None = None,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stops = [s for s in (stop or []) if s]
        self.stopped = False
        self.stop_reason: str | None = None
        self.min_tokens = min_tokens
        self._num_tokens = 0  # output tokens fed so far
        # Window state: ids[:read] are decoded and emitted (as far as UTF-8 goes); ids[read:] are
        # held back. ids only keeps tokens from the window start (older ones are dropped).
        self._ids: list[int] = list(prompt_ids[-_PROMPT_CONTEXT:]) if prompt_ids else []
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        if self._prefix_text.endswith("\ufffd"):
            # The prompt ends inside a character: context would swallow the output's first bytes.
            self._ids, self._read, self._prefix_text = [], 0, ""
        self._pending = ""  # UTF-8-final text held back because it may start a stop string
        self._protected = 0  # _pending[:_protected] is text of the first min_tokens tokens
        # characters at the start of the next delta that the first min_tokens tokens decoded,
        # when the min_tokens-th token ended inside a character (so nothing was emitted then):
        # the text up to the last of them that did not end mid-character
        self._early = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _complete_len(self) -> int:
        """Length of the decode of the longest run of the window's ids that does not end
        mid-character: the text that per-token decoding (vLLM's) has emitted by now. A token
        that ends mid-character emits nothing, not even the characters it does complete before
        that; they come out with the later token that completes the character."""
        for n in range(len(self._ids) - 1, self._read, -1):
            text = self._decode(self._ids[:n])
            if not text.endswith("\ufffd"):
                return len(text)
        return len(self._prefix_text)

    def add(self, token_ids: list[int]) -> str:
        """Feed new output tokens; return the text that became final."""
        if self.stopped or not token_ids:
            return ""
        boundary = self.min_tokens - self._num_tokens
        if 0 < boundary < len(token_ids):  # the text of the first min_tokens is checked apart
            return self.add(token_ids[:boundary]) + self.add(token_ids[boundary:])
        self._num_tokens += len(token_ids)
        self._ids.extend(token_ids)
        text = self._decode(self._ids)
        if text.endswith("\ufffd"):  # the last token ends mid-character: wait for the rest
            if self._num_tokens == self.min_tokens:  # (add splits chunks at min_tokens)
                self._early = self._complete_len() - len(self._prefix_text)
            return ""
        delta = text[len(self._prefix_text) :]
        # Slide the window: what was read becomes the context for the next decode.
        self._ids = self._ids[self._read :]
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        return self._check_stop(delta, final=False)

    def finish(self) -> str:
        """Flush everything held back (an unfinished character decodes as "\ufffd")."""
        if self.stopped:
            return ""
        delta = ""
        if len(self._ids) > self._read:
            delta = self._decode(self._ids)[len(self._prefix_text) :]
            self._ids = []
            self._read = 0
            self._prefix_text = ""
        return self._check_stop(delta, final=True)

    def _check_stop(self, delta: str, final: bool) -> str:
        if not self.stops:
            return delta
        text = self._pending + delta
        early, self._early = self._early, 0
        protected = len(text) if self._num_tokens <= self.min_tokens else self._protected + early
        # A stop string cannot start in text already emitted (that text was never held), so
        # searching the held text plus the new delta is enough.
        found = find_stop(text, self.stops, after=protected)
        if found is not None:
            self.stopped = True
            self.stop_reason = found[1]
            self._pending = ""
            return text[: found[0]]
        held = 0 if final else partial_suffix(text, tuple(self.stops))
        self._pending = text[len(text) - held :]
        self._protected = max(0, protected - (len(text) - held))
        return text[: len(text) - held]


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
