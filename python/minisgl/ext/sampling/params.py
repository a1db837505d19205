"""The sampling extension's SamplingParams fields, checked and normalized (the core's
`sampling_params` point calls `check_sampling` when one of them is set)."""

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
    try:  # JSON objects (HTTP) have string keys
        p.logit_bias = {int(k): float(v) for k, v in p.logit_bias.items()}
    except (TypeError, ValueError, AttributeError):
        raise ValueError(f"logit_bias must map token ids to numbers, got {p.logit_bias}") from None
    for name in ("frequency_penalty", "presence_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}")
    if not 0.0 < p.repetition_penalty < math.inf:
        raise ValueError(f"repetition_penalty must be > 0, got {p.repetition_penalty}")
    if any(not 0 <= t < 2**31 for t in p.logit_bias):  # the vocabulary: LogitAdjust.request
        raise ValueError(f"logit_bias token ids must be in [0, 2**31), got {p.logit_bias}")
    if any(not -100.0 <= b <= 100.0 for b in p.logit_bias.values()):
        raise ValueError(f"logit_bias values must be in [-100, 100], got {p.logit_bias}")
    if not 0 <= p.min_tokens <= p.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={p.max_tokens}], got {p.min_tokens}"
        )
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(p, name)
        if value is not None and not 0 <= value <= MAX_LOGPROBS:
            raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")


def uses_penalties(p: SamplingParams) -> bool:
    """Whether the request needs its token counts (repetition, frequency, presence)."""
    return p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 or p.repetition_penalty != 1.0


def adjusts_logits(p: SamplingParams) -> bool:
    """Whether anything (penalties, logit_bias, min_tokens) changes the model's logits."""
    return uses_penalties(p) or bool(p.logit_bias) or p.min_tokens > 0
