"""A GGUF file's tokenizer metadata as a `tokenizers.Tokenizer`, built to split text into the
ids llama.cpp's own tokenizer (src/llama-vocab.cpp) gives, plus the special-token facts
stored beside it.

`tokenizer.ggml.model` picks the algorithm:

    llama    SentencePiece BPE: merges by score, "▁" for a space, <0xNN> byte fallback
    gpt2     byte-level BPE with the file's merges, text split first by the regexes of
             `tokenizer.ggml.pre` (one table per llama.cpp pre-tokenizer type, below)
    gemma4   BPE over raw UTF-8 with "▁" for a space and <0xNN> byte fallback

Anything else (WordPiece `bert`, Unigram `t5`, RWKV, ...) is refused with ModelLoadError.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from services.common.gguf_metadata import read_metadata
from services.contracts.errors import ModelLoadError
from services.text.gguf_pretokenizers import (
    PRE_TOKENIZERS_BY_NAME,
    PreTokenizer,
    oniguruma_pattern,
)

# llama.cpp's token types (`tokenizer.ggml.token_type`, gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPACE_MARK = "\u2581"  # "▁", SentencePiece's spelling of a space


@dataclass(frozen=True, slots=True)
class GgufVocab:
    """The tokenizer keys of a GGUF file, parsed into plain types (None: the key is absent)."""

    model: str
    pre: str | None
    tokens: Sequence[str]
    token_types: Sequence[int]
    scores: Sequence[float] | None = None
    merges: Sequence[str] | None = None
    add_space_prefix: bool | None = None
    add_bos_token: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    eot_token_id: int | None = None
    eom_token_id: int | None = None
    chat_template: str | None = None
    model_name: str | None = None  # general.name: llama.cpp keys a few token rules on it

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> GgufVocab:
        """From the key-value header of a GGUF file (gguf_metadata.read_metadata)."""

        def flag(key: str) -> bool | None:
            value = metadata.get(key)
            return None if value is None else bool(value)

        def token_id(key: str) -> int | None:
            value = metadata.get(key)
            return None if value is None else int(value)

        model = metadata.get("tokenizer.ggml.model")
        tokens = metadata.get("tokenizer.ggml.tokens")
        if model is None or not tokens:
            raise ModelLoadError("the GGUF file has no tokenizer (tokenizer.ggml.model, .tokens)")
        token_types = metadata.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise ModelLoadError("GGUF tokenizer.ggml.token_type does not match the tokens")
        scores = metadata.get("tokenizer.ggml.scores")
        return cls(
            model=str(model),
            pre=metadata.get("tokenizer.ggml.pre"),
            tokens=tokens,
            token_types=token_types,
            scores=[float(score) for score in scores] if scores is not None else None,
            merges=metadata.get("tokenizer.ggml.merges"),
            add_space_prefix=flag("tokenizer.ggml.add_space_prefix"),
            add_bos_token=flag("tokenizer.ggml.add_bos_token"),
            bos_token_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_token_id=token_id("tokenizer.ggml.eos_token_id"),
            eot_token_id=token_id("tokenizer.ggml.eot_token_id"),
            eom_token_id=token_id("tokenizer.ggml.eom_token_id"),
            chat_template=metadata.get("tokenizer.chat_template"),
            model_name=metadata.get("general.name"),
        )


@dataclass(frozen=True, slots=True)
class GgufTokenizer:
    """The tokenizer a GGUF file describes and its special-token facts."""

    tokenizer: Tokenizer
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # end of sequence, then end of turn / message if distinct
    add_bos_token: bool
    chat_template: str | None


def read_gguf_tokenizer(path: Path) -> GgufTokenizer:
    return build_gguf_tokenizer(GgufVocab.from_metadata(read_metadata(path)))


def build_gguf_tokenizer(vocab: GgufVocab) -> GgufTokenizer:
    if vocab.model == "llama":
        tokenizer = _sentencepiece_tokenizer(vocab)
        add_bos = True if vocab.add_bos_token is None else vocab.add_bos_token
    else:
        pre = _pre_tokenizer(vocab)
        tokenizer = _byte_pair_tokenizer(vocab, pre)
        add_bos = pre.add_bos if vocab.add_bos_token is None else vocab.add_bos_token
        add_bos = add_bos or pre.force_bos
    eos_ids = (vocab.eos_token_id, vocab.eot_token_id, vocab.eom_token_id)
    return GgufTokenizer(
        tokenizer=tokenizer,
        bos_token_id=vocab.bos_token_id,
        eos_token_ids=tuple(dict.fromkeys(i for i in eos_ids if i is not None)),
        add_bos_token=add_bos,
        chat_template=vocab.chat_template,
    )


def _pre_tokenizer(vocab: GgufVocab) -> PreTokenizer:
    """The pre-tokenizer of a BPE vocabulary, or ModelLoadError naming what is refused."""
    if vocab.model == "gemma4":
        return PRE_TOKENIZERS_BY_NAME["gemma4"]  # llama.cpp ignores the file's pre here
    if vocab.model != "gpt2":
        reason = REFUSED_MODELS.get(vocab.model, "llama.cpp does not know it")
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.model {vocab.model!r} is not supported: {reason}"
        )
    name = vocab.pre or "default"  # as llama.cpp, which warns that quality suffers
    if name not in PRE_TOKENIZERS_BY_NAME:
        raise ModelLoadError(
            f"GGUF tokenizer.ggml.pre {vocab.pre!r} is not supported: llama.cpp does not know it"
        )
    return PRE_TOKENIZERS_BY_NAME[name]


REFUSED_MODELS = {
    "bert": "WordPiece vocabularies (BERT embedding models) are not built from GGUF yet",
    "t5": "Unigram vocabularies (T5, XLM-R) are not built from GGUF yet",
    "rwkv": "RWKV's greedy trie tokenizer has no `tokenizers` model",
    "plamo2": "PLaMo 2's Aho-Corasick tokenizer has no `tokenizers` model",
    "hybriddna": "its DNA k-mer spans inside text have no `tokenizers` equivalent",
    "whitespace": "its tokenizer drops whitespace and lowercases per llama.cpp's normalizer"
    " options; not built from GGUF yet",
    "test": "llama.cpp's test vocabulary hashes text into ids; it is no tokenizer",
    "no_vocab": "the file carries no vocabulary",
    "none": "the file carries no vocabulary",
}

# --- SentencePiece BPE ('llama') ---------------------------------------------------------


def _sentencepiece_tokenizer(vocab: GgufVocab) -> Tokenizer:
    """llama.cpp's SPM tokenizer (a port of SentencePiece's BPE): the text, with "▁" for every
    space and one more in front (add_space_prefix), starts as single characters; the adjacent
    pair whose concatenation is the vocabulary's best-scored token merges first, again and
    again; a character that is no token falls back to its <0xNN> byte tokens.

    That is byte-pair encoding with merges ranked by the score of the token they make, the
    way transformers converts these vocabularies: every split of a normal token into two
    normal tokens is a merge. Both take the leftmost of equal pairs. Where they can differ:
    - two different tokens with the same score (15 in Llama 2's vocabulary, 390 in
      Baichuan's): llama.cpp merges the leftmost, here the lower id goes first;
    - a control, byte or unused token is never a merge's result here, as in SentencePiece
      (llama.cpp could spell "</s>" or "<0x0A>" from plain text when it does not parse
      special tokens; we always do);
    - a character that is no token turns into its bytes before merging here.
    llama.cpp's vectors and random texts against a port of its algorithm agree
    (tests/unit/test_gguf_vocab_vectors.py).
    """
    if vocab.scores is None:
        raise ModelLoadError("GGUF tokenizer 'llama' needs tokenizer.ggml.scores")
    tokens = _unique_tokens(vocab.tokens)
    ids = {token: index for index, token in enumerate(tokens)}
    mergeable = {
        token: index
        for index, token in enumerate(tokens)
        if vocab.token_types[index] in (NORMAL, 0)  # 0: undefined, as older files have it
    }
    merges = _merges_by_score(mergeable, vocab.scores)
    has_bytes = all(f"<0x{byte:02X}>" in ids for byte in range(256))
    unknown = next((t for i, t in enumerate(tokens) if vocab.token_types[i] == UNKNOWN), None)
    tokenizer = Tokenizer(
        models.BPE(
            vocab=ids,
            merges=merges,
            unk_token=unknown,
            fuse_unk=False,  # one unknown token per character, as llama.cpp: bounds the count
            byte_fallback=has_bytes,
        )
    )
    # A normalizer, not a Metaspace pre-tokenizer: it runs on every stretch of text between
    # two added tokens, and llama.cpp adds the prefix space after every special token too.
    # Metaspace would also skip the prefix when the text starts with a space; llama.cpp
    # does not (" Hello" is "▁" + "▁Hello").
    replace = normalizers.Replace(" ", SPACE_MARK)
    add_space_prefix = True if vocab.add_space_prefix is None else vocab.add_space_prefix
    if add_space_prefix:
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE_MARK), replace])
    else:
        tokenizer.normalizer = replace
    tokenizer.decoder = _space_mark_decoder(strip_prefix_space=add_space_prefix)
    _add_special_tokens(tokenizer, vocab, tokens)
    return tokenizer


def _merges_by_score(mergeable: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every (left, right) whose concatenation is a token, best-scored token first."""
    ranked: list[tuple[float, int, int, str, str]] = []
    for token, index in mergeable.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[index], index, cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _space_mark_decoder(*, strip_prefix_space: bool) -> Any:
    steps = [decoders.Replace(SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()]
    if strip_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    return decoders.Sequence(steps)


# --- BPE ('gpt2', 'gemma4'); the pre-tokenizer table is in gguf_pretokenizers.py ---


def _byte_pair_tokenizer(vocab: GgufVocab, pre: PreTokenizer) -> Tokenizer:
    """llama.cpp's BPE tokenizer: the text is split into pieces by the regexes, then each
    piece (in GPT-2's byte spelling, or raw UTF-8) merges its adjacent pair of lowest merge
    rank, again and again; a piece that is no token falls back to byte tokens."""
    if vocab.merges is None:
        raise ModelLoadError(f"GGUF tokenizer {vocab.model!r} needs tokenizer.ggml.merges")
    tokens = _unique_tokens(vocab.tokens)
    ids = {token: index for index, token in enumerate(tokens)}
    merges = []
    for merge in vocab.merges:
        cut = merge.find(" ", 1)  # llama.cpp's split: the first space after the first char
        left, right = merge[:cut], merge[cut + 1 :]
        if cut > 0 and left in ids and right in ids and left + right in ids:
            merges.append((left, right))
    has_bytes = all(f"<0x{byte:02X}>" in ids for byte in range(256))
    tokenizer = Tokenizer(
        models.BPE(
            vocab=ids,
            merges=merges,
            ignore_merges=pre.ignore_merges,
            byte_fallback=not pre.byte_level and has_bytes,
        )
    )
    splits: list[Any] = [
        pre_tokenizers.Split(Regex(oniguruma_pattern(split)), behavior="isolated", invert=False)
        for split in pre.splits
    ]
    if pre.byte_level:
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tokenizer.decoder = decoders.Sequence(
            [*_added_tokens_as_text(vocab, tokens), decoders.ByteLevel()]
        )
    else:
        tokenizer.decoder = _space_mark_decoder(strip_prefix_space=False)
    if pre.escape_whitespace:
        tokenizer.normalizer = normalizers.Replace(" ", SPACE_MARK)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    _add_special_tokens(tokenizer, vocab, tokens)
    return tokenizer


def _gpt2_byte_chars() -> list[str]:
    """GPT-2's byte alphabet: the character that spells each byte in a byte-level vocabulary."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = iter(range(0x100, 0x200))
    return [chr(byte) if byte in shown else chr(next(hidden)) for byte in range(256)]


_BYTE_CHARS = _gpt2_byte_chars()
_BYTE_OF_CHAR = {char: byte for byte, char in enumerate(_BYTE_CHARS)}


def _added_tokens_as_text(vocab: GgufVocab, tokens: Sequence[str]) -> list[Any]:
    """Decoder steps that respell an added token whose text happens to use only characters
    of the byte alphabet, so that it decodes to that text, as llama.cpp decodes it: DeepSeek's
    "õ" token would otherwise decode as the byte 0xF5 (the decoder sees strings, not ids)."""
    steps = []
    for index, kind in enumerate(vocab.token_types):
        text = tokens[index]
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED) or not set(text) <= _BYTE_OF_CHAR.keys():
            continue
        if bytes(_BYTE_OF_CHAR[char] for char in text) != text.encode():
            spelt = "".join(_BYTE_CHARS[byte] for byte in text.encode())
            steps.append(decoders.Replace(Regex(rf"\A{re.escape(text)}\z"), spelt))
    return steps


# --- shared ------------------------------------------------------------------------------


def _unique_tokens(tokens: Sequence[str]) -> list[str]:
    """The token strings, an empty one renamed as llama.cpp does; a repeated one is refused
    (llama.cpp asserts on it, and ids would shift)."""
    named = [token or f"[EMPTY_{index}]" for index, token in enumerate(tokens)]
    seen: set[str] = set()
    for token in named:
        if token in seen:
            raise ModelLoadError(f"GGUF tokenizer.ggml.tokens lists {token!r} twice")
        seen.add(token)
    return named


def _add_special_tokens(tokenizer: Tokenizer, vocab: GgufVocab, tokens: Sequence[str]) -> None:
    """Tokens llama.cpp matches whole in the text before tokenizing it: control and unknown
    ones as special (left out of decoded text), user-defined ones as plain added tokens."""
    # Phi-3's added tokens swallow the whitespace after them (llama.cpp keys it on the name).
    name = (vocab.model_name or "").lower()
    phi3 = "phi-3" in name or "phi3" in name
    special: list[AddedToken] = []
    user: list[AddedToken] = []
    for index, kind in enumerate(vocab.token_types):
        if kind not in (CONTROL, UNKNOWN, USER_DEFINED):
            continue
        token = tokens[index]
        rstrip = phi3 and token not in ("<unk>", "<s>", "<|endoftext|>")
        added = AddedToken(token, special=kind != USER_DEFINED, normalized=False, rstrip=rstrip)
        (user if kind == USER_DEFINED else special).append(added)
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(user)


def normalizer_shrink_factor(normalizer: Any) -> int:
    """How many characters of text one character of normalized text can stand for, at most:
    1 when the normalizer only adds or respells (SentencePiece's "▁"), 4 when it can compose
    (NFC, NFKC fold up to 4 characters into one)."""
    if normalizer is None:
        return 1
    return _shrink_factor(json.loads(normalizer.__getstate__()))


def _shrink_factor(step: dict[str, Any]) -> int:
    kind = step.get("type")
    if kind == "Sequence":
        factor = 1
        for inner in step["normalizers"]:
            factor *= _shrink_factor(inner)
        return factor
    if kind in ("Prepend", "Lowercase", "NFD"):
        return 1
    if kind == "Replace":
        pattern = step["pattern"].get("String")
        if pattern is not None and 0 < len(pattern) <= len(step["content"]):
            return 1
    return 4
