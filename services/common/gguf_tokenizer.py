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

from services.common.errors import ModelLoadError
from services.common.gguf_metadata import read_metadata

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


# --- BPE ('gpt2', 'gemma4') --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PreTokenizer:
    """One llama.cpp pre-tokenizer: `llm_tokenizer_bpe`'s regexes for its type and the flags
    `llama_vocab::impl::load` sets for the name. The regexes are llama.cpp's, verbatim; each
    splits every piece the previous ones left, keeping the text between matches as pieces
    too (`unicode_regex_split`). `oniguruma_pattern` turns one into the `tokenizers` regex
    with the same matches."""

    splits: tuple[str, ...]
    byte_level: bool = True  # GPT-2's byte spelling; else raw UTF-8 with <0xNN> byte tokens
    escape_whitespace: bool = False  # a space becomes "▁" before splitting
    ignore_merges: bool = False  # a piece that is itself a token stays whole
    add_bos: bool = False  # llama.cpp's default when the file has no add_bos_token
    force_bos: bool = False  # BOS whatever the file says (llama.cpp's Gemma 4 workaround)


_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CJK = "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK3_WORDS = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+"
    "|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+"
)
_CASED_WORDS = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    + _CONTRACTIONS
    + r"?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    + _CONTRACTIONS
    + "?"
)
# Upper- and lower-case letters the way llama.cpp spells them: a letter that is not a-z,
# then a letter that is not A-Z (other scripts count as both).
_UPPER = r"((?=[\p{L}])([^a-z]))"
_LOWER = r"((?=[\p{L}])([^A-Z]))"
_GPT4O = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_NEWLINE_RUNS = r"[^\n]+|[\n]+"
_NORDIC = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"

_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", "[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "jais2": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)"
        r"|\s{16}(?!\S)|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}",
    ),
    "deepseek-llm": (
        "[\r\n]",
        "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293"
        "\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a"
        "\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556"
        "\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b"
        "\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d"
        "\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
        "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4"
        "\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128"
        "\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184"
        "\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b"
        "\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17"
        "\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
        "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
        "\U000118a0-\U000118df\U0001e900-\U0001e943]+",
        "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
        r"\s+$",
        _DEEPSEEK_CJK,
        r"\p{N}+",
    ),
    "deepseek3-llm": (
        r"\p{N}{1,3}",
        _CJK,
        _DEEPSEEK3_WORDS + "[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
    ),
    "spark2_5": (
        r"\p{N}{1,3}",
        _CJK,
        _DEEPSEEK3_WORDS + "|[\r\n]|\\s+(?!\\S)|\\s+",
        r"\p{N}",
    ),
    "youtu": (
        "[\uac00-\ud7a3\u3131-\u318e]+|[\uff01\u2026\u201c\u201d\u2018\u2019\u2014\uff1a"
        "\uff1b\uff0c\u3001-\u303f\ufe30-\ufe4f]+|[\u3105-\u312f]+|" + _CJK,
        _CASED_WORDS + r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "deepseek-coder": (
        "[\r\n]",
        r"\s?\p{L}+",
        r"\s?\p{P}+",
        _DEEPSEEK_CJK,
        r"\p{N}",
    ),
    "falcon": (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, "[0-9][0-9][0-9]"),
    "starcoder": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
    "qwen2": (_QWEN2,),
    "qwen35": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "poro": (_NORDIC,),
    "viking": (_NORDIC, r"\p{N}"),
    "tekken": (
        rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "chameleon": (
        "<sentinel:[0-9]+>",
        "(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z",
        r"([\t\n]|    |  )",
        r"\p{N}",
        r"[\p{P}!-/:-@\[-`{-~]",
        _GPT2,
    ),
    "gpt4o": (_GPT4O,),
    "granite-emb-multi": (_GPT4O.replace(r"(?=[\p{L}])", r"(?=[\p{L}\p{M}])"),),
    "tiny-aya": (
        r"\d{1,3}(?=(?:\d{3})*\b)",
        _CASED_WORDS + r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "kimi-k2": (r"\p{Han}+",),
    "superbpe": (r"\p{N}+", r"(?=(\d{3})+(?!\d))"),
    "bailingmoe": (
        r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "seed-coder": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "ufakzeka": (
        r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "afmoe": (
        r"\p{AFMoE_digits}",
        "[\u4e00-\u9fff\u3400-\u4dbf\u8c48-\ufaff\u3040-\u309f\u30a0-\u30ff\uff65-\uff9f"
        "\u2f00-\u2fdf\u0e40-\u0e7f\u0e80-\u0eff\u1780-\u17ff\u1000-\u109f\uaa60-\uaa7f"
        "\ua9e0-\ua9ff\uac00-\ud7af\u1100-\u11ff]+",
        # (the same words, the newlines spelt as escapes in llama.cpp's source this time)
        _DEEPSEEK3_WORDS.replace("\r\n", r"\r\n") + r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "laguna": (_NEWLINE_RUNS, _QWEN2),
    "exaone-moe": (
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n/]?|\s*[\r\n]|\s+(?!\S)|\s+",
    ),
    "newlines": (_NEWLINE_RUNS,),
    "minicpm5": (
        r"\p{N}{1,3}",
        _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+",
    ),
    "whitespace": (r"\S+",),
}


def _pre(splits: str, **flags: bool) -> PreTokenizer:
    return PreTokenizer(_SPLITS[splits], **flags)


_SPACE_MARKED = {"byte_level": False, "escape_whitespace": True}
# llama.cpp also keeps a run of newlines whole when the run is a token; Gemma 4's merges
# make each such run anyway (tests/unit/test_gguf_vocab_vectors.py).
_GEMMA4 = _pre("newlines", force_bos=True, **_SPACE_MARKED)

# Every `tokenizer.ggml.pre` value llama.cpp knows (llama_vocab::impl::load), by its regexes:
# `tokenizers` can express them all.
PRE_TOKENIZERS_BY_NAME: dict[str, PreTokenizer] = {
    "default": _pre("default"),
    "minicpm5": _pre("minicpm5", ignore_merges=True),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
        ),
        _pre("llama3", ignore_merges=True, add_bos=True),
    ),
    "deepseek-llm": _pre("deepseek-llm"),
    "deepseek-coder": _pre("deepseek-coder"),
    "deepseek-v3": _pre("deepseek3-llm"),
    "spark2_5": _pre("spark2_5"),
    "youtu": _pre("youtu", ignore_merges=True),
    "falcon": _pre("falcon"),
    "mpt": _pre("gpt2"),
    "starcoder": _pre("starcoder"),
    **dict.fromkeys(
        (
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "exaone4",
        ),
        _pre("gpt2"),
    ),
    "jais-2": _pre("jais2"),
    "gemma4": _GEMMA4,
    "granite-embed-multi-311m": _GEMMA4,
    "sarvam-moe": _pre("newlines", **_SPACE_MARKED),
    "whitespace": _pre("whitespace", byte_level=False),
    "refact": _pre("starcoder"),
    "command-r": _pre("starcoder"),
    **dict.fromkeys(
        ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan"),
        _pre("qwen2"),
    ),
    "solar-open": _pre("qwen2"),
    "qwen35": _pre("qwen35"),
    "olmo": _pre("gpt2"),
    "dbrx": _pre("llama3"),
    "smaug-bpe": _pre("llama3"),
    "poro-chat": _pre("poro"),
    "chatglm-bpe": _pre("llama3"),
    "glm4": _pre("llama3", ignore_merges=True),
    "glm5": _pre("llama3", ignore_merges=True),
    "viking": _pre("viking"),
    "jais": _pre("gpt2"),
    "tekken": _pre("tekken", ignore_merges=True, add_bos=True),
    "smollm": _pre("starcoder"),
    "codeshell": _pre("starcoder"),
    "bloom": _pre("poro"),
    "gpt3-finnish": _pre("poro"),
    "exaone": _pre("starcoder"),
    "exaone-moe": _pre("exaone-moe"),
    "chameleon": _pre("chameleon", add_bos=True),
    "minerva-7b": _pre("starcoder"),
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _pre("gpt4o")),
    "granite-embed-multi-97m": _pre("granite-emb-multi", ignore_merges=True),
    "tiny_aya": _pre("tiny-aya"),
    "cohere2moe": _pre("tiny-aya"),
    "superbpe": _pre("superbpe"),
    "trillion": _pre("gpt2"),
    "granite-docling": _pre("gpt2"),
    **dict.fromkeys(("bailingmoe", "bailingmoe2", "llada-moe"), _pre("bailingmoe")),
    "seed-coder": _pre("seed-coder"),
    "hunyuan-dense": _pre("deepseek3-llm"),
    "hy_v4": _pre("deepseek3-llm"),
    "joyai-llm": _pre("deepseek3-llm"),
    "kimi-k2": _pre("kimi-k2"),
    "ufakzeka": _pre("ufakzeka"),
    "grok-2": _pre("qwen2"),
    "afmoe": _pre("afmoe"),
    "laguna": _pre("laguna"),
    "mellum2": _pre("starcoder"),
}

# llama.cpp's hand-written splitters whose "regex" is only a name, as `tokenizers` regexes.
_HAN = (
    "\u4e00-\u9fff\u3400-\u4dbf\U00020000-\U0002a6df\U0002a700-\U0002b73f"
    "\U0002b740-\U0002b81f\U0002b820-\U0002ceaf\U0002ceb0-\U0002ebef\uf900-\ufaff"
    "\U0002f800-\U0002fa1f"
)
# unicode_regex_split_custom_afmoe: a run of digits as 1-2 leading ones, then threes; the
# text before the run stays glued to its first group ("x1234" -> "x1", "234").
_DIGIT_GROUPS = r"\P{N}*\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))"
_CUSTOM_SPLITS = {
    r"\p{AFMoE_digits}": _DIGIT_GROUPS,
    r"\d{1,3}(?=(?:\d{3})*\b)": _DIGIT_GROUPS,
    # Kimi K2 (unicode_regex_split_custom_kimi_k2): Han runs; other letters (any case)
    # with an optional leading mark and contraction; then as Llama 3.
    r"\p{Han}+": (
        f"[{_HAN}]+"
        rf"|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?"
        r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


_LETTER_CASES = ("{Lu}", "{Ll}", "{Lt}", "{Lm}", "{Lo}")


def oniguruma_pattern(pattern: str) -> str:
    """llama.cpp's regex as a `tokenizers` (Oniguruma) regex that matches the same text.

    llama.cpp runs a regex through std::regex, and one that names a Unicode class on a copy
    of the text with each non-ASCII character "collapsed" to one byte per class (letter,
    number, punctuation, mark, symbol, whitespace). Hence:
    - every letter class (\\p{Lu}, \\p{Ll}, \\p{Lt}, \\p{Lm}, \\p{Lo}) is any letter;
    - \\d is an ASCII digit;
    - $ is the end of the piece being split (std::regex's, without multiline).
    """
    if pattern in _CUSTOM_SPLITS:
        return _CUSTOM_SPLITS[pattern]
    out: list[str] = []
    in_class = False
    i = 0
    while i < len(pattern):
        char = pattern[i]
        if char == "\\":
            escape = pattern[i : i + 2]
            if escape == r"\p" and pattern[i + 2 : i + 6] in _LETTER_CASES:
                out.append(r"\p{L}")
                i += 6
                continue
            out.append(("0-9" if in_class else "[0-9]") if escape == r"\d" else escape)
            i += 2
            continue
        if char == "[" and not in_class:
            in_class = True
        elif char == "]" and in_class:
            in_class = False
        elif char == "$" and not in_class:
            char = r"\z"
        out.append(char)
        i += 1
    return "".join(out)


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
