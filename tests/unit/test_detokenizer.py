"""Incremental detokenizer on the embedded SmolLM2 tokenizer (byte-level BPE).

The invariant: the deltas plus finish() are exactly a one-shot decode of the generated ids,
for any chunking, and no delta carries a U+FFFD that the one-shot decode does not have.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models

from services.common.model_source import embedded_model_path
from services.contracts.errors import ModelLoadError
from services.text.detokenizer import (
    MAX_PENDING_TOKENS,
    NUM_CONTEXT_TOKENS,
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
)
from services.text.model_tokenizer import ModelTokenizer


def _load() -> ModelTokenizer:
    try:
        return ModelTokenizer.from_path(embedded_model_path())
    except ModelLoadError as error:  # pragma: no cover - the package is a test dependency
        pytest.skip(str(error), allow_module_level=True)


# Loaded once at import: hypothesis tests cannot take function-scoped fixtures, and the
# GGUF parse takes seconds.
MODEL_TOKENIZER = _load()
TOKENIZER: Tokenizer = MODEL_TOKENIZER.tokenizer
VOCAB_SIZE = MODEL_TOKENIZER.vocab_size
# Single-byte tokens: random sequences of these are mostly broken UTF-8, the hard case.
BYTE_TOKEN_IDS = sorted(
    token_id
    for token, token_id in TOKENIZER.get_vocab(with_added_tokens=False).items()
    if len(token) == 1
)
# Of those, the bytes 0x80-0xFF: invalid alone, so long runs of them keep text pending.
NON_ASCII_BYTE_TOKEN_IDS = [i for i in BYTE_TOKEN_IDS if TOKENIZER.decode([i]) == REPLACEMENT_CHAR]


def token_id(token: str) -> int:
    found = TOKENIZER.token_to_id(token)
    assert found is not None, token
    return found


IM_END = token_id("<|im_end|>")


def byte_token_id(byte: int) -> int:
    """The single-byte token of a byte-level BPE vocab (GPT-2's byte-to-character table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    remapped = [b for b in range(256) if b not in printable]
    char = chr(byte) if byte in printable else chr(256 + remapped.index(byte))
    return token_id(char)


# Lead bytes of 3- and 4-byte characters and continuation bytes: mostly incomplete or
# invalid sequences, sometimes a whole character. (SmolLM2 has no tokens for the bytes
# that are never valid in UTF-8, such as 0xFF.)
BROKEN_BYTE_TOKEN_IDS = [byte_token_id(b) for b in (0xE2, 0xF0, 0x82, 0x9F, 0xAC, 0x98)]


class CountingTokenizer:
    """Wraps the tokenizer and records how many ids each decode call saw."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.window_sizes: list[int] = []

    def decode(self, ids: Sequence[int], /, *, skip_special_tokens: bool = True) -> str:
        self.window_sizes.append(len(ids))
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    """Splits ids into chunks of the given sizes (cycled); the last chunk takes the rest."""
    chunks: list[list[int]] = []
    start = 0
    index = 0
    while start < len(ids):
        size = sizes[index % len(sizes)] if sizes else 1
        chunks.append(list(ids[start : start + size]))
        start += size
        index += 1
    return chunks


def stream(
    generated: Sequence[int],
    *,
    prompt: Sequence[int] = (),
    sizes: Sequence[int] = (1,),
    skip_special_tokens: bool = True,
) -> list[str]:
    detokenizer = IncrementalDetokenizer(TOKENIZER, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [detokenizer.add(chunk) for chunk in chunked(generated, sizes)]
    deltas.append(detokenizer.finish())
    assert detokenizer.num_pending_tokens == 0
    assert detokenizer.num_generated_tokens == len(generated)
    return deltas


def check_invariant(
    generated: Sequence[int], deltas: Sequence[str], *, skip_special_tokens: bool = True
) -> None:
    expected = TOKENIZER.decode(list(generated), skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == expected
    if REPLACEMENT_CHAR not in expected:
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_emoji_split_over_tokens_is_held_until_complete() -> None:
    ids = MODEL_TOKENIZER.encode("I ❤️ 😀!", add_special_tokens=False)
    assert any(REPLACEMENT_CHAR in TOKENIZER.decode([i]) for i in ids)  # really split
    deltas = stream(ids)
    check_invariant(ids, deltas)
    assert "".join(deltas) == "I ❤️ 😀!"


def test_cjk_and_accents_stream_whole_characters() -> None:
    text = "日本語のテキスト, naïve café, Ελληνικά"
    ids = MODEL_TOKENIZER.encode(text, add_special_tokens=False)
    deltas = stream(ids)
    assert "".join(deltas) == text
    assert all(REPLACEMENT_CHAR not in delta for delta in deltas)


def test_held_character_comes_out_with_the_token_that_completes_it() -> None:
    ids = MODEL_TOKENIZER.encode(" 😀", add_special_tokens=False)
    assert len(ids) >= 2
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    for token_id in ids[:-1]:
        assert detokenizer.add([token_id]) == ""
    assert detokenizer.num_pending_tokens == len(ids) - 1
    assert detokenizer.add(ids[-1:]) == " 😀"
    assert detokenizer.finish() == ""


def test_incomplete_character_at_the_end_is_flushed_as_replacement_char() -> None:
    ids = MODEL_TOKENIZER.encode("ok 😀", add_special_tokens=False)[:-1]
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    assert "".join(detokenizer.add([token_id]) for token_id in ids) == "ok"
    tail = detokenizer.finish()
    assert tail == TOKENIZER.decode(ids)[len("ok") :]
    assert tail.endswith(REPLACEMENT_CHAR)
    assert detokenizer.finish() == ""


def test_a_chunk_ending_inside_a_character_emits_what_is_complete() -> None:
    # Several ids per add() (speculative decoding): only the broken tail is held back.
    ids = MODEL_TOKENIZER.encode("fine 日本 😀", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(TOKENIZER, [])
    assert detokenizer.add(ids[:-1]) == "fine 日本"
    assert detokenizer.add(ids[-1:]) == " 😀"


def test_prompt_context_keeps_the_first_tokens_leading_space() -> None:
    prompt = MODEL_TOKENIZER.encode("The capital of France is", add_special_tokens=False)
    generated = MODEL_TOKENIZER.encode(" Paris.", add_special_tokens=False)
    assert "".join(stream(generated, prompt=prompt)) == " Paris."


def test_prompt_ending_inside_a_character_is_not_used_as_context() -> None:
    ids = MODEL_TOKENIZER.encode(" 😀 ok", add_special_tokens=False)
    # The prompt holds the first byte tokens of the emoji, the output the rest: the output
    # alone decodes to U+FFFD + " ok", and that is what must stream out.
    prompt, generated = ids[:1], ids[1:]
    deltas = stream(generated, prompt=prompt)
    check_invariant(generated, deltas)


def test_special_tokens_are_skipped_or_kept() -> None:
    ids = [*MODEL_TOKENIZER.encode("Hi there", add_special_tokens=False), IM_END]
    assert "".join(stream(ids)) == "Hi there"
    assert "".join(stream(ids, skip_special_tokens=False)) == "Hi there<|im_end|>"


def test_add_with_no_ids_returns_nothing() -> None:
    detokenizer = IncrementalDetokenizer(TOKENIZER, [1, 2, 3])
    assert detokenizer.add([]) == ""
    assert detokenizer.finish() == ""


def test_a_copy_goes_on_independently() -> None:
    fox = MODEL_TOKENIZER.encode("a 🦊 and more", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(TOKENIZER, [1, 2, 3])
    detokenizer.add(fox[:2])  # inside the emoji: held back
    copy = detokenizer.copy()
    rest = copy.add(fox[2:]) + copy.finish()
    assert detokenizer.num_pending_tokens > 0  # the original did not move
    assert detokenizer.add(fox[2:]) + detokenizer.finish() == rest
    assert copy.num_generated_tokens == detokenizer.num_generated_tokens == len(fox)


def test_decode_window_stays_small_over_a_long_output() -> None:
    text = "Streaming 😀 日本語 text, token by token. " * 60
    generated = MODEL_TOKENIZER.encode(text, add_special_tokens=False)
    assert len(generated) > 500
    counting = CountingTokenizer(TOKENIZER)
    detokenizer = IncrementalDetokenizer(counting, generated[:20])
    out = [detokenizer.add([token_id]) for token_id in generated]
    out.append(detokenizer.finish())
    assert "".join(out) == text
    # Window = the last emitted tokens (<= 4 for one character) + pending ones (<= 4).
    assert max(counting.window_sizes) <= NUM_CONTEXT_TOKENS + 4


def test_invalid_bytes_forever_do_not_grow_the_window() -> None:
    # 0xE2 0xE2 0xE2 ...: every prefix ends in an incomplete sequence, so the plain rule
    # ("hold while it ends in U+FFFD") would hold all of it until finish().
    lead_byte = byte_token_id(0xE2)
    generated = [lead_byte] * 200 + MODEL_TOKENIZER.encode(" fine", add_special_tokens=False)
    counting = CountingTokenizer(TOKENIZER)
    detokenizer = IncrementalDetokenizer(counting, [])
    deltas = [detokenizer.add([token_id]) for token_id in generated]
    deltas.append(detokenizer.finish())
    check_invariant(generated, deltas)
    assert max(counting.window_sizes) <= 2 * MAX_PENDING_TOKENS + 2
    assert sum(len(delta) for delta in deltas[:-10]) > 150  # released along the way


def test_tokenizer_protocol_accepts_model_tokenizer() -> None:
    ids = MODEL_TOKENIZER.encode("same text", add_special_tokens=False)
    detokenizer = IncrementalDetokenizer(MODEL_TOKENIZER, [])
    assert detokenizer.add(ids) + detokenizer.finish() == "same text"


# Text pieces that stress byte-level BPE: multi-byte characters, runs of spaces and
# newlines, digits (SmolLM2 splits digits one by one), accents as combining marks.
_pieces = st.sampled_from(
    [
        "a", "the", " word", "  ", "   ", "\n", "\n\n", "\t", " ", "0", "42", "1234567",
        "é", "e\u0301", "ñ", "ß", "Ω", "ж", "日", "本語", "中文字", "한국어", "€", "→",
        "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "❤️", "∑", "\u00a0", "!", "?!", "...", "<|im_end|>",
    ]
)  # fmt: skip
_texts = st.lists(_pieces, max_size=30).map("".join)
_sizes = st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=_texts, prompt_text=_texts, sizes=_sizes, skip_special_tokens=st.booleans())
def test_random_text_streams_to_its_one_shot_decode(
    text: str, prompt_text: str, sizes: list[int], skip_special_tokens: bool
) -> None:
    generated = MODEL_TOKENIZER.encode(text, add_special_tokens=False)
    prompt = MODEL_TOKENIZER.encode(prompt_text, add_special_tokens=False)
    deltas = stream(generated, prompt=prompt, sizes=sizes, skip_special_tokens=skip_special_tokens)
    check_invariant(generated, deltas, skip_special_tokens=skip_special_tokens)


_token_ids = st.one_of(
    st.integers(min_value=0, max_value=VOCAB_SIZE - 1), st.sampled_from(BYTE_TOKEN_IDS)
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    generated=st.lists(_token_ids, max_size=60),
    prompt=st.lists(_token_ids, max_size=8),
    sizes=_sizes,
    skip_special_tokens=st.booleans(),
)
def test_random_token_ids_stream_to_their_one_shot_decode(
    generated: list[int], prompt: list[int], sizes: list[int], skip_special_tokens: bool
) -> None:
    deltas = stream(generated, prompt=prompt, sizes=sizes, skip_special_tokens=skip_special_tokens)
    check_invariant(generated, deltas, skip_special_tokens=skip_special_tokens)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    generated=st.lists(
        st.one_of(
            st.sampled_from(BROKEN_BYTE_TOKEN_IDS), st.sampled_from(NON_ASCII_BYTE_TOKEN_IDS)
        ),
        min_size=20,
        max_size=120,
    ),
    sizes=_sizes,
)
def test_long_runs_of_raw_bytes_stream_to_their_one_shot_decode(
    generated: list[int], sizes: list[int]
) -> None:
    # The text keeps ending in U+FFFD for longer than MAX_PENDING_TOKENS, so the forced
    # split runs, and must never cut a sequence that later bytes continue.
    check_invariant(generated, stream(generated, sizes=sizes))


def test_byte_token_ids_are_the_bytes() -> None:
    euro = [byte_token_id(b) for b in "€".encode()]
    assert TOKENIZER.decode(euro) == "€"


# A SentencePiece-style tokenizer (Llama 2, Mistral): "▁" for spaces, <0xAB> byte-fallback
# tokens, and a decoder that strips the leading space of whatever it decodes.
_SP_WORDS = ["▁", "▁The", "▁capital", "▁is", "▁Paris", ".", "▁I", "a", "é", "▁▁"]


def _sentencepiece_tokenizer() -> tuple[Tokenizer, dict[str, int]]:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})
    vocab.update({word: 259 + index for index, word in enumerate(_SP_WORDS)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    tokenizer.add_special_tokens(
        [AddedToken("<s>", special=True), AddedToken("</s>", special=True)]
    )
    return tokenizer, vocab


SP_TOKENIZER, SP_VOCAB = _sentencepiece_tokenizer()


def sp_ids(*pieces: str) -> list[int]:
    """Token ids for words, or for the UTF-8 bytes of any other string (byte fallback)."""
    ids: list[int] = []
    for piece in pieces:
        if piece in SP_VOCAB:
            ids.append(SP_VOCAB[piece])
        else:
            ids.extend(SP_VOCAB[f"<0x{byte:02X}>"] for byte in piece.encode())
    return ids


def sp_stream(prompt: Sequence[int], generated: Sequence[int], sizes: Sequence[int]) -> list[str]:
    detokenizer = IncrementalDetokenizer(SP_TOKENIZER, prompt)
    deltas = [detokenizer.add(chunk) for chunk in chunked(generated, sizes)]
    return [*deltas, detokenizer.finish()]


def test_sentencepiece_first_token_keeps_its_space_thanks_to_the_prompt() -> None:
    prompt = sp_ids("<s>", "▁The", "▁capital", "▁is")
    generated = sp_ids("▁Paris", ".")
    assert SP_TOKENIZER.decode(generated) == "Paris."  # alone, the space is stripped
    assert "".join(sp_stream(prompt, generated, [1])) == " Paris."


def test_sentencepiece_byte_fallback_emoji_is_held_until_complete() -> None:
    generated = sp_ids("▁I", "▁", "😀", "▁is", "é", "日")
    for sizes in ([1], [2], [3, 1], [len(generated)]):
        deltas = sp_stream(sp_ids("<s>", "▁The"), generated, sizes)
        assert "".join(deltas) == " I 😀 isé日"
        assert not any(REPLACEMENT_CHAR in delta for delta in deltas)


def test_skipped_special_token_keeps_the_context_for_the_next_word() -> None:
    # Nothing visible yet: the window must not slide past the text before "</s>", or the
    # decoder would strip the space of "▁Paris" as if it started the text.
    generated = sp_ids("▁is", "</s>", "▁Paris")
    assert "".join(sp_stream(sp_ids("▁The"), generated, [1])) == " is Paris"


_sp_pieces = st.sampled_from([*_SP_WORDS, "😀", "日", "é", "€", "ß", "</s>"])


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(_sp_pieces, max_size=4),
    generated=st.lists(_sp_pieces, max_size=20),
    sizes=_sizes,
)
def test_sentencepiece_streams_the_text_that_follows_the_prompt(
    prompt: list[str], generated: list[str], sizes: list[int]
) -> None:
    # With a decoder that strips a leading space, the output's text is the one it has
    # after the prompt, not the one it has alone. Valid UTF-8 only: a byte-fallback
    # decoder turns a whole run of byte tokens into U+FFFDs when one byte is invalid, so
    # a stray byte can rewrite characters already streamed; no stream can match that.
    prompt_ids = sp_ids(*prompt)
    generated_ids = sp_ids(*generated)
    deltas = sp_stream(prompt_ids, generated_ids, sizes)
    whole = SP_TOKENIZER.decode(prompt_ids + generated_ids)
    assert "".join(deltas) == whole[len(SP_TOKENIZER.decode(prompt_ids)) :]
    assert not any(REPLACEMENT_CHAR in delta for delta in deltas)
