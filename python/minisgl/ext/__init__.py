"""The extensions: every feature beyond the engine the seeds describe, one package each. This
is the one place they register: importing a package fills its points of
`minisgl.extension.Extensions` (the core imports this module through `extensions()` and runs
without it). A new feature is a new package here plus one import line below."""

# -- packages: one import per extension, for its registrations, in the order they fill the
# points' lists and dicts (routes, request fields, step features, flag groups): serving and
# structured first, then agent, whose APIs build on both --
# isort: off
# serving: sglang routes, /metrics, --dp, HTTP limits, API processes, nodes, watchdog
import minisgl.ext.serving  # noqa: F401
import minisgl.ext.structured  # noqa: F401  (tool calls, reasoning, grammars)
import minisgl.ext.agent  # noqa: F401  (/v1/responses, Anthropic /v1/messages)
import minisgl.ext.perf  # noqa: F401  (prompts as CUDA-graph rows)
import minisgl.ext.sampling  # noqa: F401  (penalties, logit_bias, min_tokens, logprobs)
import minisgl.ext.spec  # noqa: F401  (speculative decoding: ngram, draft model)
# isort: on

# cpu: GGUF, quantized layers, torch.compile, cpu dtype; lora: LoRA adapters (after cpu: its
# model transform wraps cpu's)
from minisgl.ext import cpu, lora  # noqa: F401
