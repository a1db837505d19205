"""The sampling extension's parameters (`SamplingParams.ext`), checked and normalized (the
core's `sampling_params` point calls `check_sampling` when one of them is set)."""

from __future__ import annotations

import math

from minisgl.core import SamplingParams

MAX_LOGPROBS = 20  # top alternatives per token, as vLLM allows (OpenAI: 20 in chat)
FIELDS = (
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
)


def check_sampling(p: SamplingParams) -> None:
    """ValueError naming the field for a bad value; logit_bias's keys (strings from JSON)
    become token ids, its values floats."""
    bias = p.get("logit_bias")
    try:  # JSON objects (HTTP) have string keys
        bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {bias}") from None
    if bias:
        p.ext["logit_bias"] = bias
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= p.get(name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {p.get(name)}")
    if not 0.0 < p.get("repetition_penalty") < math.inf:
        raise ValueError(f"repetition_penalty must be > 0, got {p.get('repetition_penalty')}")
    if any(not 0 <= t < 2**31 for t in bias):  # the vocabulary: LogitAdjust.request
        raise ValueError(f"logit_bias token ids must be in [0, 2**31), got {bias}")
    if any(not -100.0 <= b <= 100.0 for b in bias.values()):
        raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
    if not 0 <= p.get("min_tokens") <= p.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.get('min_tokens')}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = p.get(name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


def uses_penalties(p: SamplingParams) -> bool:
    """Whether the request needs its token counts (repetition, frequency, presence)."""
    penalties = (p.get("frequency_penalty"), p.get("presence_penalty"), p.get("repetition_penalty"))
    return penalties != (0.0, 0.0, 1.0)


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether anything (penalties, logit_bias, min_tokens) changes the model's logits."""
    return uses_penalties(p) or bool(p.get("logit_bias")) or p.get("min_tokens") > 0
