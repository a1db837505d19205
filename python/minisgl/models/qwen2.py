"""Qwen2 is the Llama decoder with a bias on the QKV projection (ModelConfig.qkv_bias)."""

from minisgl.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    pass
