"""Qwen3 is the Llama decoder with RMSNorm over each head of q and k (ModelConfig.qk_norm)."""

from minisgl.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    pass
