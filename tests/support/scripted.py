"""A scripted tiny model: a real qwen3 checkpoint whose greedy output is a fixed text, for end
to end tests of tool calling and reasoning without any real model.

Every layer's output projections (attention o_proj, MLP down_proj) are zero, so the residual
stream at the last position is the embedding of the last token and the next token depends on
that token alone. Each token that has a successor in a script gets its own embedding axis
(a one-hot row), and the (untied) LM head maps that axis to its successor: after the final
RMSNorm the successor's logit is SUCCESSOR_SCALE * sqrt(hidden) and every other logit is 0: a
margin of about 90, so that sampling at the servers' default temperature 1.0 follows the script
too (with a margin of sqrt(hidden) alone, about 11, a 150-token answer left it once in a few
runs, depending on how the random draws fell).

A pure last-token chain cannot emit a token twice with different successors (JSON repeats
`"`), so a text script is cut into pieces that are all different strings (each piece the
shortest new one), and every piece becomes an added token of the tokenizer: the chain is
unambiguous by construction (byte-level decoding garbles added tokens with non-ASCII
characters: such a text script is refused, ValueError). A script given as token ids is checked instead (ValueError when a
token would need two successors). Each script starts after a start token that the chat template
ends its generation prompt with: `START` normally, `START_AFTER_TOOL` when the last message is a
tool result, so an agent loop can get a call first and a final answer after the tool's
result."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence

import torch
from tokenizers import AddedToken

from support.tokenizer import build_tiny_tokenizer

SUCCESSOR_SCALE = 8.0

START, START_AFTER_TOOL = "<|script|>", "<|script_after_tool|>"

# the tiny template with hermes tools (Qwen2.5's layout): tools in the system turn, assistant
# calls as <tool_call> blocks, tool results as <tool_response> blocks
TOOL_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}system: # Tools\n<tools>\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}"
    "{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}"
    "{% endif %}"
    "{{ m['role'] }}: "
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% for c in m.get('tool_calls') or [] %}"
    '<tool_call>\n{"name": "{{ c.function.name }}", "arguments": '
    "{{ c.function.arguments if c.function.arguments is string "
    "else c.function.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}"
    "{% if m['role'] == 'tool' %}<tool_response>{{ m.get('tool_call_id', '') }}"
    "</tool_response>{% endif %}"
    "{{ eos_token }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant: "
    f"{{% if messages[-1]['role'] == 'tool' %}}{START_AFTER_TOOL}{{% else %}}{START}{{% endif %}}"
    "{% endif %}"
)


def split_unique(script: str, taken: set[str]) -> list[str]:
    """Cut `script` into pieces, each the shortest string not in `taken` (which grows)."""
    pieces: list[str] = []
    pos = 0
    while pos < len(script):
        end = pos + 1
        while end <= len(script) and script[pos:end] in taken:
            end += 1
        if end > len(script):  # every prefix of the tail is taken: glue it to the last piece
            if not pieces or pieces[-1] + script[pos:] in taken:
                raise ValueError(f"cannot cut {script!r} into new pieces")
            taken.discard(pieces[-1])
            pieces[-1] += script[pos:]
            taken.add(pieces[-1])
            break
        pieces.append(script[pos:end])
        taken.add(pieces[-1])
        pos = end
    return pieces


def _chains(tokenizer, scripts: Mapping[str, str | Sequence[int]]) -> dict[int, int]:
    """successor of every token that has one; adds the text pieces to the tokenizer."""
    vocab = tokenizer.get_vocab()
    # a piece must decode to itself: byte-level vocabulary entries like "Ġ" do not
    taken = {token for token, id in vocab.items() if tokenizer.decode([id]) != token}
    texts = {start: split_unique(s, taken) for start, s in scripts.items() if isinstance(s, str)}
    pieces = [p for ps in texts.values() for p in ps if p not in vocab]
    tokenizer.add_tokens([AddedToken(p, normalized=False, special=False) for p in pieces])
    successor: dict[int, int] = {}
    for start, script in scripts.items():
        ids = tokenizer.convert_tokens_to_ids(texts[start]) if start in texts else list(script)
        if isinstance(script, str) and tokenizer.decode(ids) != script:
            raise ValueError(f"the pieces of {script!r} do not decode back to it")
        chain = [tokenizer.convert_tokens_to_ids(start), *ids, tokenizer.eos_token_id]
        for token, following in zip(chain, chain[1:]):
            if successor.setdefault(token, following) != following:
                raise ValueError(f"token {token} would need two successors in {script!r}")
    return successor


def build_scripted_model(
    path: str, script: str | Sequence[int], after_tool: str | Sequence[int] | None = None
) -> str:
    """Save at `path` a qwen3 checkpoint + tokenizer (with TOOL_CHAT_TEMPLATE) whose greedy
    answer to any chat is `script` then EOS, and `after_tool` after a tool result (default: the
    same script). Token-id scripts refer to the tiny tokenizer with tool tokens."""
    import transformers as tf

    tokenizer = build_tiny_tokenizer(tool_tokens=True)
    tokenizer.add_tokens([START, START_AFTER_TOOL], special_tokens=True)
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    scripts = {START: script, START_AFTER_TOOL: script if after_tool is None else after_tool}
    successor = _chains(tokenizer, scripts)
    hidden = 64 * math.ceil(len(successor) / 64)
    config = tf.Qwen3Config(
        vocab_size=64 * math.ceil(len(tokenizer) / 64),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
        pad_token_id=None,
    )
    torch.manual_seed(0)
    model = tf.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.lm_head.weight.zero_()
        for axis, (token, following) in enumerate(sorted(successor.items())):
            model.model.embed_tokens.weight[token].zero_()
            model.model.embed_tokens.weight[token, axis] = 1.0
            model.lm_head.weight[following, axis] = SUCCESSOR_SCALE
    model.save_pretrained(path)
    generation_config = os.path.join(path, "generation_config.json")
    if os.path.exists(generation_config):
        os.remove(generation_config)
    tokenizer.save_pretrained(path)
    return path
