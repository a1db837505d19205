"""Log-probabilities in OpenAI's two response shapes, from the detokenizer's entries
[token id, text, logprob | None, [[id, text, logprob], ...]] (minisgl.tokenizer.detokenize):
chat's `choices[].logprobs.content` and the legacy completions object (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`)."""

from __future__ import annotations

from typing import Any


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


def chat_logprobs(entries: list[list[Any]]) -> dict[str, Any]:
    """`{"content": [...]}`: each token with its bytes and its top alternatives."""
    content = [
        {**_token(text, lp), "top_logprobs": [_token(t, v) for _, t, v in top]}
        for _, text, lp, top in entries
    ]
    return {"content": content}


class CompletionLogprobs:
    """The legacy object of one choice, built across stream chunks: text offsets continue from
    the text returned before (the echoed prompt included)."""

    def __init__(self) -> None:
        self.offset = 0

    def add(self, entries: list[list[Any]]) -> dict[str, Any]:
        """The object for these tokens. `top_logprobs` maps token text to logprob: the top
        alternatives and the token itself (as vLLM returns them); None where nothing predicts
        the token (the prompt's first)."""
        offsets = []
        for _, text, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": [e[1] for e in entries],
            "token_logprobs": [e[2] for e in entries],
            "top_logprobs": [
                None if lp is None else {**{t: v for _, t, v in top}, text: lp}
                for _, text, lp, top in entries
            ],
            "text_offset": offsets,
        }
