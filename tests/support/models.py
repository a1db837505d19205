"""Tiny random models of every supported architecture, built with transformers' own config
classes and saved as safetensors checkpoints, for exactness tests against transformers."""

from __future__ import annotations

import os

import torch

COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)

ARCHS = ["llama", "llama3_tied", "qwen2", "qwen3", "mistral", "qwen3_moe"]


def build_hf_model(arch: str):
    import transformers as tf

    if arch == "llama":
        cfg = tf.LlamaConfig(**COMMON, tie_word_embeddings=False)
        cls = tf.LlamaForCausalLM
    elif arch == "llama_mqa":  # one KV head: replicated, not split, across TP ranks
        cfg = tf.LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, tie_word_embeddings=False)
        cls = tf.LlamaForCausalLM
    elif arch in ("llama3_tied", "llama3_8k"):  # llama3_8k: the original context of Llama 3.1
        scaling = dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64 if arch == "llama3_tied" else 8192,
        )
        cfg = tf.LlamaConfig(
            **COMMON, tie_word_embeddings=True, rope_scaling=scaling, rope_theta=500000.0
        )
        cls = tf.LlamaForCausalLM
    elif arch in ("llama_wide", "llama_wide_tied"):  # rows of 256: GGUF's K-quants fit
        wide = {**COMMON, "hidden_size": 256, "intermediate_size": 512}
        cfg = tf.LlamaConfig(**wide, tie_word_embeddings=arch.endswith("tied"))
        cls = tf.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=False)
        cls = tf.Qwen2ForCausalLM
    elif arch == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, head_dim=32, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif arch == "qwen3_hd128":  # GPU tests of flashinfer, whose kernels want head_dim >= 64
        cfg = tf.Qwen3Config(**COMMON, head_dim=128, tie_word_embeddings=True)
        cls = tf.Qwen3ForCausalLM
    elif arch == "mistral":
        cfg = tf.MistralConfig(**COMMON, sliding_window=None, tie_word_embeddings=False)
        cls = tf.MistralForCausalLM
    elif arch == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(
            **COMMON,
            head_dim=16,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        cls = tf.Qwen3MoeForCausalLM
    else:
        raise KeyError(arch)
    torch.manual_seed(0)
    model = cls(cfg).eval()
    if arch == "qwen2":  # transformers initialises biases to zero; make them matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.5)
    return model


def save_model(arch: str, path: str, max_shard_size: str | None = None):
    """Build and save (config + safetensors, sharded when max_shard_size is given)."""
    model = build_hf_model(arch)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    os.remove(os.path.join(path, "generation_config.json")) if os.path.exists(
        os.path.join(path, "generation_config.json")
    ) else None
    return model


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


# inductor's fused layers round bfloat16 otherwise than eager's ops (ext/cpu/aot.py; a tiny
# model's logprobs differ by up to ~0.03), so compiled tokens follow eager's up to a near tie
NEAR = 0.05


def follows(got: dict, want: dict, near: float = NEAR) -> None:
    """`got`'s greedy tokens are `want`'s, each scored within `near`, until a near tie (in
    either run the other's token within `near` of its top) where they may part (both asked
    logprobs=2)."""
    for i, (g, w) in enumerate(zip(got["token_ids"], want["token_ids"], strict=True)):
        mine, theirs = got["logprobs"][i], want["logprobs"][i]
        if g != w:
            tie = (g in theirs and theirs[w] - theirs[g] <= near) or (
                w in mine and mine[g] - mine[w] <= near
            )
            assert tie, (i, got, want)
            return
        assert abs(mine[g] - theirs[w]) <= near, (i, got, want)
