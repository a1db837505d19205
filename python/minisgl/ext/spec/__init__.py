"""Speculative decoding (`--speculative-algorithm ngram|standalone`): running requests propose
tokens, the target verifies them in one forward and keeps those it agrees with, so the output is
plain decoding's token for token. `options.py`: the flags (`scheduler_options`);
`proposers.py`: prompt lookup and a draft model; `speculator.py`: its `Speculator`, a
`step_features` entry (which requests propose, back-off, acceptance, counts); `verify.py`: the
target's tokens at every position (eagerly, or as CUDA-graph rows: the `forward_paths` point's
`VerifyRows`).
Without this package the options are refused, naming it. The scheduler's parts (torch) are
imported when a scheduler makes them (`Lazy`): the processes without one load this registry
without torch."""

from typing import Any

from minisgl.ext.lazy import Lazy
from minisgl.ext.spec.options import SpecOptions, spec_options
from minisgl.extension import ForwardPath, extensions


def _verify_rows(scheduler: Any) -> ForwardPath | None:
    on = spec_options(scheduler.config).speculative_algorithm is not None
    return Lazy("minisgl.ext.spec.verify", "VerifyRows")() if on else None


_points = extensions()
_points.scheduler_options["spec"] = SpecOptions
_points.engine_config.append(Lazy("minisgl.ext.spec.proposers", "leave_room_for_draft"))
_points.step_features.append(Lazy("minisgl.ext.spec.speculator", "make_speculation"))
_points.forward_paths.append(_verify_rows)
