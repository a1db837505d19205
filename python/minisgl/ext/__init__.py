"""The extensions: every feature beyond the engine the seeds describe, one package each. This
is the one place they register: importing a package fills its points of
`minisgl.extension.Extensions` (the core imports this module through `extensions()` and runs
without it). A new feature is a new package here plus one import line below."""

# -- packages: one import per extension, for its registrations --
import minisgl.ext.serving  # noqa: F401  (sglang routes, /metrics, --dp dispatch, LLM(dp=N))
import minisgl.ext.structured  # noqa: F401  (tool calls and reasoning: chat_features)
from minisgl.ext import cpu  # noqa: F401  (GGUF, quantized layers, torch.compile, cpu dtype)
