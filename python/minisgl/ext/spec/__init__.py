"""Speculative decoding (`--speculative-algorithm ngram|standalone`): running requests propose
tokens, the target verifies them in one forward and keeps those it agrees with, so the output is
plain decoding's token for token. `options.py`: the flags (`scheduler_options`);
`proposers.py`: prompt lookup and a draft model; `speculator.py`: the `proposer` point (which
requests propose, back-off, acceptance, counts); `verify.py`: the target's tokens at every
position (eagerly, or as CUDA-graph rows: the `forward_paths` point's `VerifyRows`).
Without this package the options are refused, naming it."""

from typing import Any

from minisgl.ext.spec.options import SpecOptions, spec_options
from minisgl.ext.spec.proposers import leave_room_for_draft
from minisgl.ext.spec.speculator import make_speculation
from minisgl.ext.spec.verify import VerifyRows
from minisgl.extension import extensions


def _verify_rows(scheduler: Any) -> VerifyRows | None:
    on = spec_options(scheduler.config).speculative_algorithm is not None
    return VerifyRows() if on else None


_points = extensions()
_points.scheduler_options["spec"] = SpecOptions
_points.engine_config.append(leave_room_for_draft)
_points.proposer = make_speculation
_points.forward_paths.append(_verify_rows)
