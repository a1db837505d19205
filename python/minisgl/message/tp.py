"""scheduler rank 0 -> ranks > 0 (tensor parallelism), once per step over the control group."""

from __future__ import annotations

from dataclasses import dataclass, field

from minisgl.core import SamplingParams
from minisgl.message.base import register


@register
@dataclass
class TPAddMsg:
    """A request rank 0 added, with its sampling seed (one drawn at random there must be the
    same on every rank)."""

    uid: int
    input_ids: list[int]
    params: SamplingParams
    seed: int


@register
@dataclass
class TPStepMsg:
    """Rank 0's adds (TPAddMsg) and aborts (AbortBackendMsg) since its previous step, in order;
    `stop`: rank 0 is done and the other ranks return."""

    changes: list = field(default_factory=list)
    stop: bool = False
