"""Qwen3-MoE is Qwen3 with top-k routed experts in the layers listed by ModelConfig.moe."""

from minisgl.models.llama import LlamaForCausalLM


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    pass
