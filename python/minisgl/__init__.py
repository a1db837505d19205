"""minisgl: a compact, fast LLM inference engine."""

from minisgl.core import SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str):  # import the engine lazily: `import minisgl` stays light
    if name == "LLM":
        from minisgl.llm import LLM

        return LLM
    raise AttributeError(name)
