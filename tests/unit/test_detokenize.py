from dataclasses import dataclass
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from minisgl.extension import ExtensionMissing
from minisgl.message import BatchMsg, DetokInitMsg, ExitMsg, SchedulerStats
from minisgl.tokenizer.detokenize import IncrementalDetokenizer, request_detokenizer
from support.tokenizer import build_tiny_tokenizer

TOK = build_tiny_tokenizer()
FFFD = "\ufffd"

# Everything byte-level BPE must survive: ASCII, accents, CJK, emoji (incl. modifiers and ZWJ).
_PIECES = list("aé ü\nñ你好世界龘") + ["😀", "🚀", "👍🏽", "👨‍👩‍👧", "❤️"]
TEXT = st.lists(
    st.one_of(
        st.characters(min_codepoint=1, exclude_categories=("Cs",), exclude_characters=FFFD),
        st.sampled_from(_PIECES),
    ),
    max_size=30,
).map("".join)
SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """Split ids into chunks of the given sizes (cycled), as a scheduler might deliver them."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def run(ids, sizes=(1,), min_tokens=0, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    if min_tokens:  # the sampling extension's rule
        detok = request_detokenizer(TOK, [], True, kwargs["stop"], min_tokens)
    else:
        detok = IncrementalDetokenizer(TOK, **kwargs)
    deltas = [detok.add(chunk) for chunk in chunked(ids, list(sizes))]
    deltas.append(detok.finish())
    return deltas, detok


def reference_stop(text: str, stops: list[str]) -> tuple[str, str | None]:
    """Read `text` one character at a time; cut before the first stop string to complete."""
    for k in range(1, len(text) + 1):
        done = [s for s in stops if s and text[:k].endswith(s)]
        if done:
            s = max(done, key=len)  # same end: the longer one started first
            return text[: k - len(s)], s
    return text, None


@SETTINGS
@given(text=TEXT, sizes=st.lists(st.integers(1, 4), max_size=5))
def test_text_round_trips(text, sizes):
    ids = TOK.encode(text)
    assert TOK.decode(ids) == text  # byte-level BPE is lossless
    deltas, _ = run(ids, sizes)
    assert "".join(deltas) == text
    assert not any(FFFD in d for d in deltas)


@SETTINGS
@given(
    ids=st.lists(st.integers(0, len(TOK) - 1), max_size=40),
    sizes=st.lists(st.integers(1, 4), max_size=5),
    skip=st.booleans(),
)
def test_arbitrary_ids_match_full_decode(ids, sizes, skip):
    # Random ids include lone continuation bytes, truncated characters and special tokens.
    full = TOK.decode(ids, skip_special_tokens=skip)
    deltas, _ = run(ids, sizes, skip_special_tokens=skip)
    assert "".join(deltas) == full
    if FFFD not in full:
        assert not any(FFFD in d for d in deltas)


@SETTINGS
@given(prompt=TEXT, text=TEXT)
def test_prompt_context_does_not_change_output(prompt, text):
    deltas, _ = run(TOK.encode(text), prompt_ids=TOK.encode(prompt))
    assert "".join(deltas) == text


def test_prompt_ending_mid_character():
    # The output's first token completes the prompt's last character: the output alone decodes
    # to a leading "\ufffd", and that is what the deltas must add up to.
    full = TOK.encode("abc 龘")
    prompt_ids, out = full[:-1], full[-1:] + TOK.encode("hi 你好")
    assert TOK.decode(prompt_ids).endswith(FFFD)
    deltas, _ = run(out, prompt_ids=prompt_ids)
    assert "".join(deltas) == TOK.decode(out) == FFFD + "hi 你好"


def _metaspace_tokenizer():
    """A sentencepiece-style tokenizer: the decoder drops the leading space of the first token,
    so decoding a token on its own differs from decoding it after others."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁hello": 1, "▁world": 2, "▁again": 3, "!": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_context_keeps_leading_spaces():
    sp = _metaspace_tokenizer()
    assert sp.decode([2]) == "world" and sp.decode([1, 2]) == "hello world"
    detok = IncrementalDetokenizer(sp, prompt_ids=[1])
    assert [detok.add([i]) for i in [2, 3, 4]] == [" world", " again", "!"]
    detok = IncrementalDetokenizer(sp)  # no prompt: the output decodes as it would on its own
    assert "".join(detok.add([i]) for i in [2, 3, 4]) + detok.finish() == "world again!"


def test_multibyte_character_is_held_until_complete():
    ids = TOK.encode("a龘b")
    assert len(ids) == 5  # a, three single-byte tokens, b
    detok = IncrementalDetokenizer(TOK)
    assert [detok.add([i]) for i in ids] == ["a", "", "", "龘", "b"]
    assert detok.finish() == ""


def test_finish_flushes_incomplete_character():
    ids = TOK.encode("ok 龘")[:-1]
    detok = IncrementalDetokenizer(TOK)
    deltas = [detok.add([i]) for i in ids]
    assert "".join(deltas) == "ok "
    tail = detok.finish()
    assert tail.endswith(FFFD)
    assert "".join(deltas) + tail == TOK.decode(ids)
    assert detok.finish() == ""


def test_window_stays_small():
    """Each step decodes a few recent tokens, not the whole output."""
    lengths = []

    class CountingTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return TOK.decode(ids, skip_special_tokens=skip_special_tokens)

    text = "hello 你好 😀 café 龘 👍🏽 world " * 30
    ids = TOK.encode(text)
    assert len(ids) > 300
    detok = IncrementalDetokenizer(CountingTokenizer(), prompt_ids=TOK.encode("prompt " * 50))
    out = "".join(detok.add([i]) for i in ids) + detok.finish()
    assert out == text
    assert max(lengths) <= 10
    assert len(lengths) <= 2 * len(ids) + 2


def test_empty_add_is_noop():
    detok = IncrementalDetokenizer(TOK, prompt_ids=TOK.encode("x"))
    assert detok.add([]) == ""
    assert detok.add(TOK.encode(" world")) == " world"
    assert detok.add([]) == ""
    assert detok.finish() == ""


# ---- stop strings ---------------------------------------------------------------------------

_STOP_ALPHABET = list("ab c\n你好😀")
SMALL_TEXT = st.text(st.sampled_from(_STOP_ALPHABET), max_size=30)
STOPS = st.lists(st.text(st.sampled_from(_STOP_ALPHABET), min_size=1, max_size=4), max_size=3)


@SETTINGS
@given(text=SMALL_TEXT, stops=STOPS, sizes=st.lists(st.integers(1, 3), max_size=4))
def test_stop_strings_match_reference(text, stops, sizes):
    ids = TOK.encode(text)
    expected, reason = reference_stop(text, stops)
    detok = IncrementalDetokenizer(TOK, stop=stops)
    emitted = ""
    for chunk in chunked(ids, sizes):
        was_stopped = detok.stopped
        delta = detok.add(chunk)
        if was_stopped:
            assert delta == ""
        emitted += delta
        # Never ahead of the truth: what is out is a prefix of the final answer.
        assert expected.startswith(emitted)
    emitted += detok.finish()
    assert emitted == expected
    assert detok.stopped == (reason is not None)
    assert detok.stop_reason == reason


@SETTINGS
@given(text=TEXT, data=st.data())
def test_stop_taken_from_the_text(text, data):
    # Stop strings cut out of the text itself, so they do occur (often across token boundaries).
    stops = []
    if text:
        for _ in range(data.draw(st.integers(1, 3))):
            i = data.draw(st.integers(0, len(text) - 1))
            j = data.draw(st.integers(i + 1, min(len(text), i + 6)))
            stops.append(text[i:j])
    expected, reason = reference_stop(text, stops)
    deltas, detok = run(TOK.encode(text), stop=stops)
    assert "".join(deltas) == expected
    assert detok.stop_reason == reason


def test_stop_spanning_tokens_never_leaks():
    ids = TOK.encode("hello world")
    assert len(ids) == 2  # "hello", " world"
    detok = IncrementalDetokenizer(TOK, stop=["lo wo"])
    assert detok.add(ids[:1]) == "hel"  # "lo" might start the stop string: held
    assert not detok.stopped
    assert detok.add(ids[1:]) == ""
    assert detok.stopped and detok.stop_reason == "lo wo"
    assert detok.add(TOK.encode(" more")) == ""
    assert detok.finish() == ""


def test_held_text_released_when_ruled_out():
    detok = IncrementalDetokenizer(TOK, stop=["abc"])
    assert detok.add(TOK.encode("xab")) == "x"
    assert detok.add(TOK.encode("d")) == "abd"
    assert detok.add(TOK.encode("ab")) == ""
    assert detok.finish() == "ab"  # the output ended: held text is final
    assert not detok.stopped


@pytest.mark.parametrize(
    "stops, text, expected, reason",
    [
        (["abcd", "bc"], "abcde", "a", "bc"),  # "bc" completes before "abcd"
        (["abcd", "bcx"], "abcdx", "", "abcd"),
        (["abcd", "bcx"], "abcx", "a", "bcx"),
        (["ab", "b"], "xab", "x", "ab"),  # same end: the longer (earlier) one wins
        (["aa"], "baaa", "b", "aa"),
        (["好", "你好"], "x你好", "x", "你好"),
        (["😀"], "hi 😀 there", "hi ", "😀"),
        (["\n\n"], "line\nline\n\nrest", "line\nline", "\n\n"),
        ([""], "empty stops are ignored", "empty stops are ignored", None),
    ],
)
def test_stop_cases(stops, text, expected, reason):
    for sizes in [(1,), (2,), (100,)]:
        deltas, detok = run(TOK.encode(text), sizes, stop=stops)
        assert "".join(deltas) == expected
        assert detok.stop_reason == reason


def test_stop_detected_on_the_completing_token():
    ids = TOK.encode("the quick brown fox")
    detok = IncrementalDetokenizer(TOK, stop=["brown"])
    fed = []
    for i in ids:
        fed.append(i)
        detok.add([i])
        if detok.stopped:
            break
    assert detok.stopped
    assert TOK.decode(fed).endswith("brown")


def test_skip_special_tokens():
    ids = TOK.encode("hi") + [TOK.eos_token_id] + TOK.encode(" there") + [TOK.pad_token_id]
    deltas, _ = run(ids)
    assert "".join(deltas) == "hi there"
    deltas, _ = run(ids, skip_special_tokens=False)
    assert "".join(deltas) == "hi<|eos|> there<|pad|>"


def test_special_token_as_stop_string():
    ids = TOK.encode("hi") + [TOK.eos_token_id] + TOK.encode(" there")
    deltas, detok = run(ids, skip_special_tokens=False, stop=["<|eos|>"])
    assert "".join(deltas) == "hi"
    assert detok.stopped
    deltas, detok = run(ids, skip_special_tokens=True, stop=["<|eos|>"])
    assert "".join(deltas) == "hi there"
    assert not detok.stopped


# ---- min_tokens: no stop string ends the output before that many tokens --------------------
# (ext/sampling's MinTokensDetokenizer, through the `detokenize` point)


@pytest.mark.usefixtures("core_alone")
def test_min_tokens_with_stop_strings_needs_the_sampling_extension():
    with pytest.raises(ExtensionMissing, match="min_tokens needs the sampling extension"):
        request_detokenizer(TOK, [], True, ["x"], 2)
    assert type(request_detokenizer(TOK, [], True, [], 2)) is IncrementalDetokenizer


def reference_min_tokens(ids: list[int], stops: list[str], min_tokens: int) -> str:
    """vLLM's rule: only a stop string that ends in text decoded after token min_tokens counts
    (it may start before); text belongs to the first token after which it decodes, and a token
    that ends mid-character passes all its text (characters before that included) on."""
    text = TOK.decode(ids)
    if min_tokens >= len(ids):
        return text
    j = min_tokens
    while j > 0 and TOK.decode(ids[:j]).endswith(FFFD):
        j -= 1
    boundary = len(TOK.decode(ids[:j]))
    for k in range(boundary + 1, len(text) + 1):
        done = [s for s in stops if s and text[:k].endswith(s)]
        if done:
            return text[: k - len(max(done, key=len))]
    return text


@pytest.mark.ext
@SETTINGS
@given(
    text=SMALL_TEXT,
    stops=STOPS,
    min_tokens=st.integers(0, 12),
    sizes=st.lists(st.integers(1, 3), max_size=4),
)
# Token 3 carries the space and the first bytes of the second 你 (decode(ids[:3]) == "你 \ufffd"):
# its text, space included, belongs to token 4, after min_tokens, so the stop " " counts there.
@example(text="你 你", stops=[" "], min_tokens=3, sizes=[])
# "a", "a", then token 3 ends mid-character (all three fed at once): both "a"s stay protected.
@example(text="aa你", stops=["a"], min_tokens=3, sizes=[3])
def test_min_tokens_matches_reference(text, stops, min_tokens, sizes):
    ids = TOK.encode(text)
    deltas, _ = run(ids, sizes, stop=stops, min_tokens=min_tokens)
    assert "".join(deltas) == reference_min_tokens(ids, stops, min_tokens)


@pytest.mark.ext
def test_min_tokens_skips_early_stop_strings():
    ids = TOK.encode("ab ab ab")
    assert len(ids) == 6  # "a", "b", " a", "b", " a", "b"
    for min_tokens, expected in [(0, ""), (1, ""), (2, "ab "), (4, "ab ab ")]:
        deltas, detok = run(ids, stop=["ab"], min_tokens=min_tokens)
        assert "".join(deltas) == expected and detok.stop_reason == "ab"
    deltas, detok = run(ids, stop=["ab"], min_tokens=len(ids))
    assert "".join(deltas) == "ab ab ab" and not detok.stopped


@pytest.mark.ext
def test_min_tokens_stop_straddling_the_boundary_cuts_where_it_starts():
    ids = TOK.encode("hello world")
    assert len(ids) == 2  # "hello", " world"
    deltas, detok = run(ids, stop=["lo wo"], min_tokens=1)  # starts in token 1, ends in token 2
    assert "".join(deltas) == "hel" and detok.stop_reason == "lo wo"
    deltas, detok = run(ids, stop=["ell"], min_tokens=1)  # wholly within token 1: ignored
    assert "".join(deltas) == "hello world" and not detok.stopped


@dataclass
class ExtensionAnswer:
    """A message the detokenizer does not know (as ext/serving's /flush_cache answer)."""

    api_rank: int


def test_the_detokenizer_passes_on_what_it_does_not_know_in_order(monkeypatch):
    """The detokenizer process's loop: a request's init with nothing to say sends nothing, the
    stats go on, then a message of a type it does not know goes on unchanged after them (the
    order /flush_cache's answer relies on: /stats read after it shows the emptied cache)."""
    from minisgl.models import hf
    from minisgl.tokenizer import detokenize as detok_mod

    stats, answer = SchedulerStats(free_pages=7), ExtensionAnswer(1)
    inbox = [DetokInitMsg(5, 3, [1, 2]), BatchMsg([], stats), answer, ExitMsg()]
    sent: list[object] = []
    monkeypatch.setattr(hf, "load_tokenizer", lambda path: TOK)
    monkeypatch.setattr(detok_mod, "freeze_startup_heap", lambda: 0)
    monkeypatch.setattr(detok_mod, "ZmqPushQueue", lambda addr, create: None)
    monkeypatch.setattr(
        detok_mod, "ZmqPullQueue", lambda addr, create: SimpleNamespace(get=lambda: inbox.pop(0))
    )
    to_api = SimpleNamespace(put=sent.append)
    ready = SimpleNamespace(send=lambda msg: None)
    detok_mod.run_detokenizer("model", "ipc://in", lambda: to_api, ["ipc://sched"], ready)
    assert sent == [BatchMsg([], stats), answer]
