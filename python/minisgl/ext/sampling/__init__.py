"""Sampling beyond the core's sampler: logit_bias, min_tokens and the repetition, frequency
and presence penalties (`adjust.py`, a logits processor, with its kernel `adjust_kernel.py`),
and the log-probabilities of sampled and prompt tokens (`logprobs.py`, observers of the raw
logits and of a prefill's hidden states, with `logprobs_kernel.py`); min_tokens' rule for stop
strings and the log-probabilities' token texts in the detokenizer (`detokenize.py`); their HTTP
fields and the responses' `logprobs` (`http.py`). Registered as the `sampling_params` checks of
their SamplingParams fields, as `step_features`, `detokenize` and `request_fields`: without this
package a request that sets one of those fields is refused, naming it. The step features
(torch) are imported when a scheduler makes them (`Lazy`): the processes without one load this
registry without torch."""

from minisgl.ext.lazy import Lazy
from minisgl.ext.sampling import http
from minisgl.ext.sampling.detokenize import SamplingDetokenize
from minisgl.ext.sampling.params import FIELDS, check_sampling
from minisgl.extension import extensions

_LOGPROBS = "minisgl.ext.sampling.logprobs"
_points = extensions()
_points.sampling_params.update(dict.fromkeys(FIELDS, check_sampling))
_points.step_features += [
    Lazy("minisgl.ext.sampling.adjust", "LogitAdjust"),
    lambda _: Lazy(_LOGPROBS, "Logprobs")(),
    lambda _: Lazy(_LOGPROBS, "PromptScoring")(),
]
_points.detokenize = SamplingDetokenize()
for _path, _models in http.FIELDS.items():
    _points.request_fields.setdefault(_path, []).extend(_models)
