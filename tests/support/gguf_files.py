"""Tiny random models written as llama.cpp GGUF files (gguf's own tensor names, Llama's q/k row
permutation, a mix of F32 / F16 / Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K tensors,
optionally a tokenizer with chat template), for the GGUF and quantization tests. The gguf
package quantizes all but the K-quants, which `quantize_k` and `quantize_q6_k` write (it
dequantizes every kind)."""

from __future__ import annotations

import json
import math

import gguf
import numpy as np
import torch

from support.models import build_hf_model
from support.tokenizer import CHAT_TEMPLATE, build_tiny_tokenizer

Q = gguf.GGMLQuantizationType
GGUF_ARCH = {
    "llama": gguf.MODEL_ARCH.LLAMA,
    "qwen2": gguf.MODEL_ARCH.QWEN2,
    "qwen3": gguf.MODEL_ARCH.QWEN3,
}
# the types of the 2-D tensors, in turn (1-D ones are F32, as llama.cpp keeps them)
QTYPES = {
    "llama": [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16, Q.F32],
    "qwen2": [Q.F16, Q.Q8_0],
    "qwen3": [Q.Q4_1, Q.F16, Q.Q8_0],
}


def llama_cpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama's q/k rows (pairs the two rotary halves)."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def add_tokenizer(writer: gguf.GGUFWriter, vocab_size: int) -> None:
    """The tiny byte-level BPE as a llama.cpp 'gpt2' vocabulary, padded to the model's size."""
    tok = build_tiny_tokenizer()
    tokens = [f"<|extra_{i}|>" for i in range(vocab_size)]
    for text, i in tok.get_vocab().items():
        tokens[i] = text
    special = set(tok.all_special_ids) | set(range(len(tok), vocab_size))
    types = [
        gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL for i in range(vocab_size)
    ]
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(tok.bos_token_id)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_chat_template(CHAT_TEMPLATE)


def llama_cpp_rope_freqs(cfg, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3.1 rope scaling."""
    rope = cfg.rope_parameters
    inv = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    old, low, high = 8192, 1.0, 4.0  # llama.cpp reads these where HF configs never put them
    wavelen = 2 * math.pi / inv
    smooth = (old / wavelen - low) / (high - low)
    blended = 1 / ((1 - smooth) / rope["factor"] + smooth)
    factors = np.where(wavelen > old / low, rope["factor"], blended)
    return np.where(wavelen < old / high, 1.0, factors).astype(np.float32)


def six_bit_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight (sc, m) pairs [..., 8] of 6-bit values as Q4_K's 12 bytes [..., 12]."""
    low = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    high = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    extra = (sc[..., 4:] & 15) | ((m[..., 4:] & 15) << 4)
    return np.concatenate([low, high, extra], axis=-1).astype(np.uint8)


def quantize_k(data: np.ndarray, bits: int = 4) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) as Q4_K (`bits` 4) or Q5_K (5) blocks,
    uint8 [rows, cols / 256 * (144 or 176)]: each 32-weight sub-block's step and minimum
    (w = step q - min) in 6 bits against the block's float16 d and dmin, the codes rounded to
    the nearest (llama.cpp also searches for a better step; the file format is the same)."""
    rows, top = data.shape[0], 2**bits - 1
    x = data.astype(np.float32).reshape(rows, -1, 8, 32)
    low = np.minimum(x.min(-1), 0)
    step, lowest = (x.max(-1) - low) / top, -low
    d = (step.max(-1, keepdims=True) / 63).astype(np.float16)
    dmin = (lowest.max(-1, keepdims=True) / 63).astype(np.float16)
    safe = lambda v: np.where(v > 0, v, 1)  # noqa: E731 (an all-zero block: codes of 0)
    sc = np.clip(np.rint(step / safe(d.astype(np.float32))), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(lowest / safe(dmin.astype(np.float32))), 0, 63).astype(np.uint8)
    scale, offset = d.astype(np.float32) * sc, dmin.astype(np.float32) * m
    q = np.rint((x + offset[..., None]) / safe(scale)[..., None])
    q = np.clip(q, 0, top).astype(np.uint8)
    pairs = q.reshape(rows, -1, 4, 2, 32) & 15
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(rows, -1, 128)
    head = np.concatenate([d.view(np.uint8), dmin.view(np.uint8)], axis=-1).reshape(rows, -1, 4)
    parts = [head, six_bit_bytes(sc, m)]
    if bits == 5:  # bit k of byte j: sub-block k's weight j's fifth bit
        fifth = (q >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8)[:, None]
        parts.append(np.bitwise_or.reduce(fifth, axis=2))
    return np.concatenate([*parts, qs], axis=-1).reshape(rows, -1)


def quantize_q6_k(data: np.ndarray) -> np.ndarray:
    """float32 [rows, cols] (cols a multiple of 256) as Q6_K blocks, uint8 [rows, cols / 256 *
    210]: each 16 weights' step in int8 against the block's float16 d (sc = -128 where the
    largest magnitude is negative, as llama.cpp does), codes q - 32 rounded to the nearest in
    -32..31; then 128 bytes of low nibbles, 64 of high bit pairs, the 16 scales, d."""
    rows = data.shape[0]
    x = data.astype(np.float32).reshape(rows, -1, 16, 16)
    big = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)[..., 0]  # signed
    step = big / -32  # the largest magnitude takes code -32
    top = np.take_along_axis(step, np.abs(step).argmax(-1)[..., None], -1)
    d = (top / -128).astype(np.float16)
    safe = lambda v: np.where(v != 0, v, 1)  # noqa: E731 (an all-zero block: codes of 0)
    sc = np.clip(np.rint(step / safe(d.astype(np.float32))), -128, 127).astype(np.int8)
    scale = d.astype(np.float32) * sc
    q = np.clip(np.rint(x / safe(scale)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(rows, -1, 2, 4, 32)  # [.., half, j, l]: weight 32 j + l
    low = q & 15
    ql = (low[:, :, :, 0:2] | (low[:, :, :, 2:4] << 4)).reshape(rows, -1, 128)
    high = (q >> 4) << np.arange(0, 8, 2, dtype=np.uint8)[:, None]
    qh = np.bitwise_or.reduce(high, axis=3).reshape(rows, -1, 64)
    parts = [ql, qh, sc.view(np.uint8), d.view(np.uint8)]
    return np.concatenate(parts, axis=-1).reshape(rows, -1)


def quantize(data: np.ndarray, qtype: Q) -> np.ndarray:
    kquants = {Q.Q4_K: 4, Q.Q5_K: 5}
    if qtype == Q.Q6_K:
        return quantize_q6_k(data)
    if qtype in kquants:
        return quantize_k(data, kquants[qtype])
    return gguf.quants.quantize(data, qtype)


def write_gguf(
    model: str, path: str, with_tokenizer: bool = False, qtypes: list[Q] | None = None
) -> torch.nn.Module:
    """Write a tiny random model (a name from models.py) as a GGUF file; returns the
    transformers model holding exactly the weights the file holds (each tensor quantized and
    dequantized). `qtypes`: the types of the 2-D tensors in turn (default: QTYPES')."""
    arch = "llama" if model.startswith(("llama", "mistral")) else model  # as llama.cpp names them
    hf = build_hf_model(model)
    cfg = hf.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
    w = gguf.GGUFWriter(path, arch)
    w.add_name(model)  # transformers reads a llama GGUF named "mistral..." as Mistral
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    if with_tokenizer:
        add_tokenizer(w, cfg.vocab_size)
    if rope.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(cfg, head_dim))
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    qtypes = qtypes or QTYPES[arch]
    state = hf.state_dict()
    count = 0
    for name, tensor in state.items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = tensor.numpy()
        qtype = Q.F32
        if data.ndim == 2:
            qtype, count = qtypes[count % len(qtypes)], count + 1
        # quantization works on blocks within a row, so the row permutation commutes with it
        state[name] = torch.from_numpy(gguf.quants.dequantize(quantize(data, qtype), qtype).copy())
        gname = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if arch == "llama" and gname.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in gname else cfg.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        w.add_tensor(gname, quantize(data, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    hf.load_state_dict(state)
    return hf
