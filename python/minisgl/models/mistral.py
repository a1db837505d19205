"""Mistral is the Llama decoder; its sliding window is handled by the attention backend."""

from minisgl.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    pass
