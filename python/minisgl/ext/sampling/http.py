"""The sampling extension's HTTP fields (the `request_fields` point): the logit adjustments
on every generating path, log-probabilities in OpenAI's two response shapes, from the
detokenizer's entries [token id, text, logprob | None, [[id, text, logprob], ...]]
(minisgl.tokenizer.detokenize): chat's `choices[].logprobs.content` and the legacy completions
object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`), and the completions' `echo`
(the prompt before the completion, and its log-probabilities)."""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Annotated, Any

from pydantic import Field

from minisgl.ext.sampling.params import MAX_LOGPROBS
from minisgl.ext.serving.api_tokenizer import with_tokenizer
from minisgl.server.protocol import APIError, ExtensionFields, Int64
from minisgl.tokenizer.server import needed

# top alternatives per token: OpenAI's limit is 5 (completions) and 20 (chat); vLLM's 20 for both
TopLogprobs = Annotated[int | None, Field(None, ge=0, le=MAX_LOGPROBS)]


class AdjustFields(ExtensionFields):
    """OpenAI's penalties and logit_bias, repetition_penalty and min_tokens as vLLM spells them
    (SamplingParams checks their values)."""

    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None  # JSON keys: token ids as strings
    min_tokens: Int64 = 0

    def params(self, req: Any) -> dict[str, Any]:
        return self.model_dump(exclude_unset=True, exclude_none=True)


class ChatLogprobFields(ExtensionFields):
    logprobs: bool = False
    top_logprobs: TopLogprobs = None

    def params(self, req: Any) -> dict[str, Any]:
        """SamplingParams.logprobs: None unless asked (top_logprobs alone is a mistake)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        return {"logprobs": self.top_logprobs or 0} if self.logprobs else {}

    async def shaper(self, chat: bool, msgs: list[Any], api: Any) -> Logprobs | None:
        return Logprobs(chat) if self.logprobs else None


class CompletionLogprobFields(ExtensionFields):
    logprobs: TopLogprobs = None  # the sampled tokens' logprobs, with this many alternatives
    echo: bool = False  # the prompt before the completion (max_tokens 0: the prompt alone)

    def params(self, req: Any) -> dict[str, Any]:
        """With echo, the prompt's too (none predicts its first token: null)."""
        if self.logprobs is None:
            return {}
        return {"logprobs": self.logprobs, "prompt_logprobs": self.logprobs if self.echo else None}

    def allows_no_tokens(self) -> bool:
        return self.echo

    async def shaper(self, chat: bool, msgs: list[Any], api: Any) -> Logprobs | Echo | None:
        logprobs = None if self.logprobs is None else Logprobs(chat)
        return Echo(await prompt_texts(msgs, api), logprobs) if self.echo else logprobs


async def prompt_texts(msgs: list[Any], api: Any) -> list[str]:
    """Each choice's prompt as given: its text, or its token ids decoded (once per prompt: the
    n choices of one share its list)."""
    decoded: dict[int, str] = {}
    for m in msgs:
        if m.text is None and id(m.input_ids) not in decoded:
            decode = functools.partial(_decode, ids=m.input_ids)
            decoded[id(m.input_ids)] = await with_tokenizer(api, decode, "prompt")
    return [m.text if m.text is not None else decoded[id(m.input_ids)] for m in msgs]


def _decode(tokenizer: Any, ids: list[int]) -> str:
    return needed(tokenizer).decode(ids)


class Echo:
    """The echo (a `ChoiceShaper`): each choice's prompt before its first reply's text, and
    the log-probabilities (the prompt's first) when asked."""

    def __init__(self, prompts: list[str], logprobs: Logprobs | None) -> None:
        self.prompts, self.logprobs = prompts, logprobs

    def add(self, index: int, reply: Any) -> None:
        if self.logprobs is not None:
            self.logprobs.add(index, reply)
        reply.text_delta, self.prompts[index] = self.prompts[index] + reply.text_delta, ""

    def fields(self, index: int) -> dict[str, Any]:
        return {} if self.logprobs is None else self.logprobs.fields(index)


def _token(text: str, logprob: float) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}


class Logprobs:
    """A response's `logprobs` per choice (a `ChoiceShaper`), of the entries its replies brought
    since the last chunk (an echoed prompt's first): chat's `{"content": [...]}` or the legacy
    object, whose text offsets continue from the text returned before (the prompt included)."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.entries: dict[int, list[list[Any]]] = defaultdict(list)
        self.offsets: dict[int, int] = defaultdict(int)

    def add(self, index: int, reply: Any) -> None:
        self.entries[index] += reply.ext.get("prompt_logprobs", []) + reply.ext.get("logprobs", [])

    def fields(self, index: int) -> dict[str, Any]:
        entries = self.entries.pop(index, [])
        if self.chat:
            content = [
                {**_token(text, lp), "top_logprobs": [_token(t, v) for _, t, v in top]}
                for _, text, lp, top in entries
            ]
            return {"logprobs": {"content": content}}
        return {"logprobs": self.legacy(index, entries)}

    def legacy(self, index: int, entries: list[list[Any]]) -> dict[str, Any]:
        """`top_logprobs` maps token text to logprob: the top alternatives and the token itself
        (as vLLM returns them); None where nothing predicts the token (the prompt's first)."""
        offsets = []
        for _, text, _, _ in entries:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        return {
            "tokens": [e[1] for e in entries],
            "token_logprobs": [e[2] for e in entries],
            "top_logprobs": [
                None if lp is None else {**{t: v for _, t, v in top}, text: lp}
                for _, text, lp, top in entries
            ],
            "text_offset": offsets,
        }


FIELDS: dict[str, list[type[ExtensionFields]]] = {
    "/v1/chat/completions": [AdjustFields, ChatLogprobFields],
    "/v1/completions": [AdjustFields, CompletionLogprobFields],
    "/generate": [AdjustFields],
}
