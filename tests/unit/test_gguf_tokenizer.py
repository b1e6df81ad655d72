"""The GGUF tokenizer builder on its own: refusals, a small SentencePiece vocabulary, the
regex translation and llama.cpp's hand-written splitters (ported here line by line), the
normalizer bound and the header reader. llama.cpp's real vocabularies are in
test_gguf_vocab_vectors.py."""

from __future__ import annotations

import random
import unicodedata
from collections.abc import Callable

import pytest
from tokenizers import Regex, normalizers, pre_tokenizers

from services.common.gguf_metadata import field_value, open_gguf, read_metadata
from services.common.model_source import embedded_model_path
from services.contracts.errors import ModelLoadError
from services.text.gguf_pretokenizers import oniguruma_pattern
from services.text.gguf_vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    SPACE_MARK,
    UNKNOWN,
    USER_DEFINED,
    GgufVocab,
    build_gguf_tokenizer,
    normalizer_shrink_factor,
)
from services.text.model_tokenizer import ModelTokenizer

# --- refusals ----------------------------------------------------------------------------


def byte_pair_vocab(**changes: object) -> GgufVocab:
    fields: dict[str, object] = {
        "model": "gpt2",
        "pre": "gpt-2",
        "tokens": ["a", "b", "ab", "<|end|>"],
        "token_types": [NORMAL, NORMAL, NORMAL, CONTROL],
        "merges": ["a b"],
    }
    return GgufVocab(**(fields | changes))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "bpe"}, "tokenizer.ggml.model 'bpe' is not supported: llama.cpp does not"),
        ({"model": "rwkv"}, "tokenizer.ggml.model 'rwkv' is not supported: RWKV's greedy trie"),
        ({"model": "bert"}, "'bert' is not supported: WordPiece vocabularies"),
        ({"pre": "gpt-5"}, "tokenizer.ggml.pre 'gpt-5' is not supported: llama.cpp does not"),
        ({"merges": None}, "needs tokenizer.ggml.merges"),
        ({"tokens": ["a", "b", "a", "x"]}, "lists 'a' twice"),
    ],
)
def test_refusals_name_the_key_and_the_value(changes: dict[str, object], message: str) -> None:
    with pytest.raises(ModelLoadError, match=message):
        build_gguf_tokenizer(byte_pair_vocab(**changes))


def test_a_missing_pre_tokenizer_is_llama_cpps_default() -> None:
    missing = build_gguf_tokenizer(byte_pair_vocab(pre=None)).tokenizer.pre_tokenizer
    default = build_gguf_tokenizer(byte_pair_vocab(pre="default")).tokenizer.pre_tokenizer
    assert missing.__getstate__() == default.__getstate__()


# --- a small SentencePiece vocabulary ----------------------------------------------------

# Scored as SentencePiece scores them: a merge's token scores lower than the ones before it.
PIECES = ["▁", "H", "e", "l", "o", "He", "ll", "llo", "Hello", "▁Hello", "▁H", "▁▁"]


def sentencepiece_vocab(**changes: object) -> GgufVocab:
    specials = ["<unk>", "<s>", "</s>", "<|user|>"]
    tokens = [*specials, *(f"<0x{byte:02X}>" for byte in range(256)), *PIECES]
    types = [UNKNOWN, CONTROL, CONTROL, USER_DEFINED, *[BYTE] * 256, *[NORMAL] * len(PIECES)]
    fields: dict[str, object] = {
        "model": "llama",
        "pre": "default",
        "tokens": tokens,
        "token_types": types,
        "scores": [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(PIECES))],
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return GgufVocab(**(fields | changes))


def sentencepiece_tokenizer(**changes: object) -> ModelTokenizer:
    built = build_gguf_tokenizer(sentencepiece_vocab(**changes))
    return ModelTokenizer(
        built.tokenizer,
        chat_template=built.chat_template,
        bos_token_id=built.bos_token_id,
        eos_token_ids=built.eos_token_ids,
        add_bos_token=built.add_bos_token,
        special_tokens={},
    )


def piece_ids(*pieces: str) -> list[int]:
    return [4 + 256 + PIECES.index(piece) for piece in pieces]


def test_sentencepiece_spaces_as_llama_cpp() -> None:
    tokenizer = sentencepiece_tokenizer()
    assert tokenizer.add_bos_token  # llama.cpp's default for SentencePiece files
    assert tokenizer.encode("Hello", add_special_tokens=False) == piece_ids("▁Hello")
    # A leading space gets its own "▁": the prefix space is added whatever the text is.
    assert tokenizer.encode(" Hello", add_special_tokens=False) == piece_ids("▁", "▁Hello")
    # After an added token the prefix space comes again, as llama.cpp adds it there too.
    assert tokenizer.encode("<s>Hello<|user|>Hello") == [
        1,
        *piece_ids("▁Hello"),
        3,
        *piece_ids("▁Hello"),
    ]
    assert tokenizer.decode(tokenizer.encode(" Hello  Hello")) == " Hello  Hello"


def test_sentencepiece_falls_back_to_bytes() -> None:
    tokenizer = sentencepiece_tokenizer()
    assert tokenizer.encode("\né", add_special_tokens=False) == [
        *piece_ids("▁"),
        4 + 0x0A,
        4 + 0xC3,
        4 + 0xA9,
    ]
    assert tokenizer.decode(tokenizer.encode("\né")) == "\né"


def test_sentencepiece_without_space_prefix() -> None:
    tokenizer = sentencepiece_tokenizer(add_space_prefix=False, add_bos_token=False)
    assert not tokenizer.add_bos_token
    assert tokenizer.encode("Hello") == piece_ids("Hello")
    assert tokenizer.decode(piece_ids("▁Hello")) == " Hello"


def test_phi3_added_tokens_swallow_the_whitespace_after_them() -> None:
    tokenizer = sentencepiece_tokenizer(model_name="Phi3")
    assert tokenizer.encode("<|user|>\n Hello</s> Hello", add_special_tokens=False) == [
        3,
        *piece_ids("▁Hello"),
        2,
        *piece_ids("▁Hello"),
    ]
    # ... except the ones llama.cpp leaves alone
    assert tokenizer.encode("<s> Hello") == [1, *piece_ids("▁", "▁Hello")]


def test_sentencepiece_bounds_chars_per_token() -> None:
    tokenizer = sentencepiece_tokenizer()
    assert tokenizer.max_chars_per_token == len("<|user|>")
    for text in ("", " ", "Hello" * 9, "  \n\n  ", "éééé", "<s><s>"):
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) * tokenizer.max_chars_per_token >= len(text)


# --- regexes -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("llama_cpp", "ours"),
    [
        (r"[\p{Lu}\p{Ll}\p{M}]+|\p{Lo}", r"[\p{L}\p{L}\p{M}]+|\p{L}"),
        (r"\d{3}|[\d.]", "[0-9]{3}|[0-9.]"),
        (r"\s+$|[$]|\$", r"\s+\z|[$]|\$"),
        (r"\p{N}+|[\\p{L}]", r"\p{N}+|[\\p{L}]"),
    ],
)
def test_regexes_keep_llama_cpps_meaning(llama_cpp: str, ours: str) -> None:
    assert oniguruma_pattern(llama_cpp) == ours


def splitter(pattern: str) -> Callable[[str], list[str]]:
    split = pre_tokenizers.Split(Regex(oniguruma_pattern(pattern)), behavior="isolated")
    return lambda text: [piece for piece, _ in split.pre_tokenize_str(text)]


ALPHABET = (
    "abcXYZ  '''sSdtTmMrevl\n\r\t\u3000.,!?-_/中文字漢日本語ひらがなカタカナ한국어éÉàñß"
    "0123456789٣٤¼½😀🚀\u200d\u0301"
)


def random_texts(count: int) -> list[str]:
    rng = random.Random(0)
    return ["".join(rng.choices(ALPHABET, k=rng.randint(1, 14))) for _ in range(count)]


def test_digit_groups_split_as_llama_cpps_afmoe_splitter() -> None:
    ours = splitter(r"\p{AFMoE_digits}")
    assert ours("x1234567y") == ["x1", "234", "567", "y"]
    for text in random_texts(3000):
        assert ours(text) == afmoe_digits(text), text


def test_kimi_k2_splits_as_llama_cpps_splitter() -> None:
    ours = splitter(r"\p{Han}+")
    assert ours("Hello中文World's 1234") == ["Hello", "中文", "World's", " ", "123", "4"]
    for text in random_texts(3000):
        assert ours(text) == kimi_k2(text), text


# Ports of unicode_regex_split_custom_afmoe and unicode_regex_split_custom_kimi_k2.


def is_letter(char: str | None) -> bool:
    return char is not None and unicodedata.category(char).startswith("L")


def is_number(char: str | None) -> bool:
    return char is not None and unicodedata.category(char).startswith("N")


def is_whitespace(char: str | None) -> bool:
    """Unicode's White_Space, as llama.cpp's table has it."""
    spaces = "\t\n\v\f\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000"
    return char is not None and (char in spaces or "\u2000" <= char <= "\u200a")


def is_han(char: str | None) -> bool:
    han = (
        (0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x2A700, 0x2B73F),
        (0x2B740, 0x2B81F), (0x2B820, 0x2CEAF), (0x2CEB0, 0x2EBEF), (0xF900, 0xFAFF),
        (0x2F800, 0x2FA1F),
    )  # fmt: skip
    return char is not None and any(low <= ord(char) <= high for low, high in han)


class Pieces:
    def __init__(self, text: str) -> None:
        self.text, self.pieces, self.end = text, [], 0

    def char(self, pos: int) -> str | None:
        return self.text[pos] if 0 <= pos < len(self.text) else None

    def add(self, end: int) -> None:
        if end > self.end:
            self.pieces.append(self.text[self.end : end])
        self.end = end


def afmoe_digits(text: str) -> list[str]:
    out, pos = Pieces(text), 0
    while pos < len(text):
        if not is_number(text[pos]):
            pos += 1
            continue
        start = pos
        while is_number(out.char(pos)):
            pos += 1
        current = start + (pos - start) % 3
        if current > start:
            out.add(current)
        while current < pos:
            current += 3
            out.add(current)
    out.add(len(text))
    return out.pieces


def kimi_k2(text: str) -> list[str]:
    out, pos, size = Pieces(text), 0, len(text)
    get = out.char
    while pos < size:
        char = get(pos)
        if is_han(char):
            while is_han(get(pos)):
                pos += 1
            out.add(pos)
            continue
        leading = not (char in "\r\n" or is_letter(char) or is_number(char))
        if (is_letter(char) and not is_han(char)) or (
            leading and is_letter(get(pos + 1)) and not is_han(get(pos + 1))
        ):
            pos += leading
            while is_letter(get(pos)) and not is_han(get(pos)):
                pos += 1
            if get(pos) == "'" and pos + 1 < size:
                if text[pos + 1].lower() in "stmd":
                    pos += 2
                elif pos + 2 < size and text[pos + 1 : pos + 3].lower() in ("re", "ve", "ll"):
                    pos += 3
            out.add(pos)
            continue
        if is_number(char):
            start = pos
            while is_number(get(pos)):
                pos += 1
                if pos - start >= 3:
                    out.add(pos)
                    start = pos
            out.add(pos)
            continue
        after_space = get(pos + 1) if char == " " else char
        if after_space is not None and not (
            is_whitespace(after_space) or is_letter(after_space) or is_number(after_space)
        ):
            pos += char == " "
            while get(pos) is not None and not (
                is_whitespace(get(pos)) or is_letter(get(pos)) or is_number(get(pos))
            ):
                pos += 1
            while get(pos) in ("\r", "\n"):
                pos += 1
            out.add(pos)
            continue
        count, last_newline = 0, 0
        while is_whitespace(get(pos + count)):
            if get(pos + count) in "\r\n":
                last_newline = pos + count + 1
            count += 1
        if last_newline:
            pos = last_newline
        elif count > 1 and get(pos + count) is not None:
            pos += count - 1
        else:
            pos += max(count, 1)
        out.add(pos)
    return out.pieces


# --- the character bound and the header reader -------------------------------------------


def test_normalizer_shrink_factor() -> None:
    spm = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), normalizers.Replace(" ", "▁")])
    assert normalizer_shrink_factor(None) == 1
    assert normalizer_shrink_factor(spm) == 1
    assert normalizer_shrink_factor(normalizers.Sequence([spm, normalizers.NFKC()])) == 4
    assert normalizer_shrink_factor(normalizers.Replace("ab", "c")) == 4


def test_the_header_reader_agrees_with_gguf_reader() -> None:
    path = embedded_model_path()
    reader = open_gguf(path)
    metadata = read_metadata(path)
    assert metadata.keys() == {key for key in reader.fields if not key.startswith("GGUF.")}
    for key, value in metadata.items():
        assert value == field_value(reader, key), key
