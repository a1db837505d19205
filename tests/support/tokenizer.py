"""A tiny byte-level BPE tokenizer trained locally (no network), shared by the tests.

Byte-level means every string encodes, and multi-byte characters (CJK, emoji, accents) are
often split across tokens: exactly what the incremental detokenizer must cope with."""

from __future__ import annotations

import random

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>"]
# tool_tokens=True: the tags of the tool-call and reasoning formats, ordinary tokens as in Qwen's
# tokenizers, and special ones as in Mistral's and Llama's
TOOL_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
TOOL_SPECIAL_TOKENS = ["[TOOL_CALLS]", "[ARGS]", "<|python_tag|>"]
VOCAB_SIZE = 480

# Roles are plain text, so a model sees them as ordinary tokens; bos opens the conversation and
# eos closes every turn, which is where a tiny model learns (or is forced) to stop.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}"
    "{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

_WORDS = (
    "the a cat dog runs jumps over lazy quick brown fox hello world model token cache page "
    "prefix radix decode prefill batch server request stream answer question small fast "
    "café naïve résumé über straße señor façade jalapeño crème brûlée "
    "你好 世界 模型 缓存 请求 今天 天气 很好 我们 学习 "
    "😀 🚀 🎉 👍 🔥 ❤️ 🤖 🌍"
).split()


def _corpus(n: int = 400) -> list[str]:
    rng = random.Random(0)  # fixed corpus: the trained merges (and token ids) are stable
    lines = []
    for _ in range(n):
        words = rng.choices(_WORDS, k=rng.randint(3, 12))
        lines.append(" ".join(words) + rng.choice([".", "!", "?", ",", ""]))
    return lines


def build_tiny_tokenizer(
    path: str | None = None, tool_tokens: bool = False
) -> PreTrainedTokenizerFast:
    """Train a ~480-token byte-level BPE with bos/eos/pad and a chat template; save it to
    `path` (save_pretrained) when given. `tool_tokens` adds TOOL_TOKENS and TOOL_SPECIAL_TOKENS
    after the trained vocabulary (the ids of everything else stay the same)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: nothing is unk
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf.chat_template = CHAT_TEMPLATE
    if tool_tokens:
        hf.add_tokens([AddedToken(t, normalized=False, special=False) for t in TOOL_TOKENS])
        hf.add_tokens([AddedToken(t, normalized=False) for t in TOOL_SPECIAL_TOKENS], True)
    if path is not None:
        hf.save_pretrained(path)
    return hf
