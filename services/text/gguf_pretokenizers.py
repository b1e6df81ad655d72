"""llama.cpp's pre-tokenizers (src/llama-vocab.cpp, `llm_tokenizer_bpe`): for each
`tokenizer.ggml.pre` name, the regexes that split text before BPE merges and the flags
llama.cpp sets for it, and the translation of its regex dialect into the `tokenizers`
library's (Oniguruma). Used by services/text/gguf_vocab.py."""

from __future__ import annotations

from dataclasses import dataclass


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
