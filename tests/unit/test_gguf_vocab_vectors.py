"""Our GGUF tokenizers against llama.cpp's own test vectors.

The llama.cpp that llama-cpp-python 0.3.36 vendors ships vocabulary-only GGUF files
(models/ggml-vocab-*.gguf), most with input texts (.inp, separated by
"\\n__ggml_vocab_test__\\n") and the ids llama.cpp must give them (.out, one line each).
tests/test-tokenizer-0.cpp runs them with `common_tokenize(ctx, text, add_special=false,
parse_special=false)`: no BOS, and every case must match exactly. Here each case must give
the same ids, and decode back to its text the way llama.cpp's `common_detokenize` does.

The sources come through `ensure_source`: a fresh machine downloads the sdist from PyPI
once, into the cache that `llmserve bench peers` uses.
"""

from __future__ import annotations

import heapq
import random
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from benchmarks.llamacpp_build import PeerBuildError, ensure_source
from services.common.gguf_metadata import read_metadata
from services.contracts.errors import ModelLoadError
from services.text.gguf_pretokenizers import PRE_TOKENIZERS_BY_NAME
from services.text.gguf_vocab import (
    BYTE,
    CONTROL,
    NORMAL,
    REFUSED_MODELS,
    SPACE_MARK,
    UNKNOWN,
    USER_DEFINED,
)
from services.text.model_tokenizer import ModelTokenizer

# Every vocabulary file of llama.cpp's models/ directory, and why we refuse it (None: built).
VOCABS: dict[str, str | None] = {
    "aquila": None,
    "baichuan": None,
    "bert-bge": "WordPiece vocabularies (BERT embedding models) are not built from GGUF yet",
    "command-r": None,
    "deepseek-coder": None,
    "deepseek-llm": None,
    "falcon": None,
    "gemma-4": None,
    "gpt-2": None,
    "gpt-neox": None,
    "llama-bpe": None,
    "llama-spm": None,
    "mpt": None,
    "nomic-bert-moe": "Unigram vocabularies (T5, XLM-R) are not built from GGUF yet",
    "phi-3": None,
    "qwen2": None,
    "qwen35": None,
    "refact": None,
    "starcoder": None,
}
BUILT = [name for name, refusal in VOCABS.items() if refusal is None]

# A SentencePiece and a regex-split BPE vocabulary whose transformers GGUF loading agrees
# with every llama.cpp vector (not all do: its Llama converter puts no prefix "▁" before a
# leading space, its Falcon one splits digits differently, ...).
AGREES_WITH_TRANSFORMERS = ("phi-3", "qwen2")

SEPARATOR = "\n__ggml_vocab_test__\n"


@pytest.fixture(scope="session")
def llama_cpp_source() -> Path:
    try:
        return ensure_source()
    except PeerBuildError as exc:
        pytest.skip(f"llama.cpp's sources are not available (offline?): {exc}")


@pytest.fixture(scope="session")
def tokenizers() -> dict[str, ModelTokenizer]:
    """Each vocabulary's tokenizer, built once for all the tests that need it."""
    return {}


def vocab_path(source: Path, name: str) -> Path:
    return source / "models" / f"ggml-vocab-{name}.gguf"


def built(source: Path, tokenizers: dict[str, ModelTokenizer], name: str) -> ModelTokenizer:
    if name not in tokenizers:
        tokenizers[name] = ModelTokenizer.from_path(vocab_path(source, name))
    return tokenizers[name]


def read_cases(path: Path) -> dict[str, list[int]]:
    """The cases of `path`.inp/.out, read as test-tokenizer-0.cpp's read_tests does (a map:
    the empty text comes once)."""
    raw = path.with_name(path.name + ".inp").read_text(encoding="utf-8")
    texts, pos = [], 0
    while pos < len(raw):
        end = raw.find(SEPARATOR, pos)
        if end < 0:
            texts.append(raw[pos:])
            break
        texts.append(raw[pos:end])
        pos = end + len(SEPARATOR)
    lines = path.with_name(path.name + ".out").read_text(encoding="utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) == len(texts), f"{path.name}: {len(texts)} inputs, {len(lines)} outputs"
    return {text: [int(i) for i in line.split()] for text, line in zip(texts, lines, strict=True)}


# --- llama.cpp's tables, read from its source -------------------------------------------


def cpp_string(literal: str) -> str:
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'"}
    return re.sub(r"\\(.)", lambda match: escapes[match.group(1)], literal)


def llama_cpp_pre_names(source: Path) -> dict[str, dict[str, Any]]:
    """`tokenizer.ggml.pre` name -> its llama_vocab_pre_type and the flags load() sets."""
    text = (source / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    start = text.index('} else if (tokenizer_pre == "default") {')
    end = text.index('throw std::runtime_error(format("unknown pre-tokenizer type')
    names: dict[str, dict[str, Any]] = {}
    for block in text[start:end].split("} else if ("):
        pre_type = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", block)
        if pre_type is None:
            continue
        flags = re.findall(r"\b(\w+) = (true|false);", block)
        for name in re.findall(r'tokenizer_pre == "([^"]+)"', block):
            names[name] = {"type": pre_type.group(1)} | {f: v == "true" for f, v in flags}
    return names


def llama_cpp_pre_types(source: Path) -> dict[str, tuple[list[str], bool]]:
    """llama_vocab_pre_type -> (its regexes, whether it spells bytes as GPT-2 does), from
    llm_tokenizer_bpe's constructor."""
    text = (source / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    start = text.index("struct llm_tokenizer_bpe : llm_tokenizer {")
    end = text.index("std::vector<std::string> regex_exprs;", start)
    body = re.sub(r"^\s*//.*$", "", text[start:end], flags=re.MULTILINE)
    types: dict[str, tuple[list[str], bool]] = {}
    for block in body.split("break;"):
        listed = re.search(r"regex_exprs = \{(.*?)\};", block, re.DOTALL)
        if listed is None:
            continue
        literals = re.findall(r'^\s*"((?:[^"\\]|\\.)*)",?\s*(?://.*)?$', listed[1], re.MULTILINE)
        regexes = [cpp_string(literal) for literal in literals]
        names = re.findall(r"case LLAMA_VOCAB_PRE_TYPE_(\w+):", block)
        for name in [*names, *(["DEFAULT"] if "default:" in block else [])]:
            types[name] = (regexes, "byte_encode = false" not in block)
    return types


def llama_cpp_models(source: Path) -> list[str]:
    text = (source / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    return sorted(set(re.findall(r'tokenizer_model == "([^"]+)"', text)))


def test_every_vocab_file_is_listed(llama_cpp_source: Path) -> None:
    files = (llama_cpp_source / "models").glob("ggml-vocab-*.gguf")
    assert sorted(f.name.removeprefix("ggml-vocab-").removesuffix(".gguf") for f in files) == (
        sorted(VOCABS)
    )


def test_every_pre_tokenizer_is_llama_cpps(llama_cpp_source: Path) -> None:
    """Our table is llama.cpp's, verbatim: the same names, regexes and flags."""
    names = llama_cpp_pre_names(llama_cpp_source)
    types = llama_cpp_pre_types(llama_cpp_source)
    assert sorted(PRE_TOKENIZERS_BY_NAME) == sorted(names)
    for name, pre in PRE_TOKENIZERS_BY_NAME.items():
        regexes, byte_encode = types.get(names[name]["type"], types["DEFAULT"])
        flags = names[name]
        assert list(pre.splits) == regexes, name
        assert pre.byte_level == byte_encode, name
        assert pre.ignore_merges == flags.get("ignore_merges", False), name
        assert pre.add_bos == flags.get("add_bos", False), name
        assert pre.escape_whitespace == flags.get("escape_whitespaces", False), name


def test_every_tokenizer_model_is_built_or_refused(llama_cpp_source: Path) -> None:
    for model in llama_cpp_models(llama_cpp_source):
        assert model in ("llama", "gpt2", "gemma4") or model in REFUSED_MODELS, model


# --- the vectors -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(VOCABS))
def test_vocab_vectors(
    llama_cpp_source: Path, tokenizers: dict[str, ModelTokenizer], name: str
) -> None:
    path = vocab_path(llama_cpp_source, name)
    refusal = VOCABS[name]
    if refusal is not None:
        with pytest.raises(ModelLoadError, match=re.escape(refusal)):
            ModelTokenizer.from_path(path)
        return
    tokenizer = built(llama_cpp_source, tokenizers, name)
    metadata = read_metadata(path)
    detokenize = LlamaCppDetokenizer(metadata, llama_cpp_pre_names(llama_cpp_source))
    for token, kind in enumerate(metadata["tokenizer.ggml.token_type"]):
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):  # DeepSeek's "õ" among them
            assert tokenizer.decode([token], skip_special_tokens=False) == detokenize([token])
    if not path.with_name(path.name + ".inp").is_file():
        # No vectors of its own: the other files' texts must at least come back whole.
        texts = read_cases(vocab_path(llama_cpp_source, "llama-bpe"))
        for text in texts:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert tokenizer.decode(ids, skip_special_tokens=False) == text
        return
    wrong = []
    for text, expected in read_cases(path).items():
        ids = tokenizer.encode(text, add_special_tokens=False)
        decoded = tokenizer.decode(ids, skip_special_tokens=False)
        if ids != expected:
            wrong.append(f"{text!r}: {ids} instead of {expected}")
        elif decoded != text:
            wrong.append(f"{text!r} decodes to {decoded!r}")
        elif detokenize.clean(decoded) != detokenize(expected):
            wrong.append(f"{text!r}: llama.cpp decodes it to {detokenize(expected)!r}")
    assert not wrong, "\n".join(wrong)


def test_gemma4_newline_runs_that_are_tokens_stay_whole(
    llama_cpp_source: Path, tokenizers: dict[str, ModelTokenizer]
) -> None:
    """llama.cpp's rule for Gemma 4 (llm_tokenizer_bpe_session), which merges give here."""
    tokenizer = built(llama_cpp_source, tokenizers, "gemma-4")
    for count in range(1, 64):
        token = tokenizer.tokenizer.token_to_id("\n" * count)
        if token is not None:
            assert tokenizer.encode("\n" * count, add_special_tokens=False) == [token], count


@pytest.mark.parametrize("name", BUILT)
def test_described_tokenizer_matches_the_file(
    llama_cpp_source: Path, tokenizers: dict[str, ModelTokenizer], name: str
) -> None:
    """The tokenizer crosses processes as JSON (ModelDescription); the rebuilt one is the
    same, and its max_chars_per_token bounds every case."""
    tokenizer = built(llama_cpp_source, tokenizers, name)
    description = tokenizer.describe(
        model_name=name, vocab_size=tokenizer.vocab_size, max_model_len=4096, eos_token_ids=()
    )
    rebuilt = ModelTokenizer.from_description(description)
    assert rebuilt.max_chars_per_token == tokenizer.max_chars_per_token
    assert (rebuilt.bos_token_id, rebuilt.eos_token_ids, rebuilt.add_bos_token) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_ids,
        tokenizer.add_bos_token,
    )
    for text in sample_texts(llama_cpp_source, name):
        ids = tokenizer.encode(text)
        assert rebuilt.encode(text) == ids
        assert rebuilt.decode(ids) == tokenizer.decode(ids)
        assert len(ids) * tokenizer.max_chars_per_token >= len(text)


def sample_texts(source: Path, name: str) -> Iterator[str]:
    path = vocab_path(source, name)
    own = path.with_name(path.name + ".inp").is_file()
    yield from read_cases(path if own else vocab_path(source, "llama-bpe"))
    yield "<s>[INST] Hi [/INST]<|im_start|>user\n  two spaces<|im_end|>\n" + "x" * 300


@pytest.mark.slow
@pytest.mark.parametrize("name", AGREES_WITH_TRANSFORMERS)
def test_transformers_gguf_loading_agrees(
    llama_cpp_source: Path, tokenizers: dict[str, ModelTokenizer], name: str
) -> None:
    from transformers import AutoTokenizer

    path = vocab_path(llama_cpp_source, name)
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = built(llama_cpp_source, tokenizers, name)
    texts = [*read_cases(path), "def f(x):\n\treturn x ** 2  # 😀 ça va\r\n", " " * 17]
    for text in texts:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text


# --- SentencePiece: merges by score are llama.cpp's algorithm ----------------------------


@pytest.mark.parametrize("name", ["llama-spm", "phi-3", "baichuan"])
def test_sentencepiece_merges_match_llama_cpps_algorithm(
    llama_cpp_source: Path, tokenizers: dict[str, ModelTokenizer], name: str
) -> None:
    """Random texts give the ids of a line-by-line port of llm_tokenizer_spm_session.

    Texts avoid "<": llama.cpp's SPM can merge plain text into a control or byte token
    ("</s>", "<0x0A>") when special tokens are not parsed; SentencePiece never does, and
    neither do we (special tokens are always parsed).
    """
    metadata = read_metadata(vocab_path(llama_cpp_source, name))
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    scores: list[float] = metadata["tokenizer.ggml.scores"]
    types: list[int] = metadata["tokenizer.ggml.token_type"]
    tokenizer = built(llama_cpp_source, tokenizers, name)
    ids = {token: index for index, token in enumerate(tokens)}
    rng = random.Random(0)
    words = [t.replace(SPACE_MARK, " ") for t, k in zip(tokens, types, strict=True) if k == NORMAL]
    alphabet = "aeiouxyzAEZ019 .,!?'-\n\t  éàüßñçøœ€—абвгдежзкмнопрст中文日本語한국어🙂🚀\u200d"
    wrong = []
    for _ in range(400):
        pieces = [
            rng.choice(words) if rng.random() < 0.7 else "".join(rng.choices(alphabet, k=3))
            for _ in range(rng.randint(1, 12))
        ]
        text = "".join(pieces).replace("<", "")
        expected = llama_cpp_spm(text, ids, scores)
        if tokenizer.encode(text, add_special_tokens=False) != expected:
            wrong.append(text)
    assert not wrong, wrong[:5]


def llama_cpp_spm(text: str, ids: Mapping[str, int], scores: Sequence[float]) -> list[int]:
    """llm_tokenizer_spm_session::tokenize on one fragment (add_space_prefix: true)."""
    symbols = list((" " + text).replace(" ", SPACE_MARK))
    following = [*range(1, len(symbols)), -1]
    preceding = list(range(-1, len(symbols) - 1))
    queue: list[tuple[float, int, int, int]] = []

    def try_add_bigram(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        token = ids.get(symbols[left] + symbols[right])
        if token is not None:
            size = len(symbols[left]) + len(symbols[right])
            heapq.heappush(queue, (-scores[token], left, right, size))

    for index in range(1, len(symbols)):
        try_add_bigram(index - 1, index)
    while queue:
        _, left, right, size = heapq.heappop(queue)
        if not symbols[left] or not symbols[right] or len(symbols[left] + symbols[right]) != size:
            continue
        symbols[left] += symbols[right]
        symbols[right] = ""
        following[left] = following[right]
        if following[right] >= 0:
            preceding[following[right]] = left
        try_add_bigram(preceding[left], left)
        try_add_bigram(left, following[left])
    output = []
    index = 0
    while index != -1:
        symbol = symbols[index]
        if symbol in ids:
            output.append(ids[symbol])
        else:
            output.extend(ids[f"<0x{byte:02X}>"] for byte in symbol.encode("utf-8"))
        index = following[index]
    return output


# --- llama.cpp's detokenizer -------------------------------------------------------------


class LlamaCppDetokenizer:
    """llama_vocab::impl::detokenize(remove_special=false, unparse_special=true), as
    common_detokenize calls it: each token's piece, the first one without its prefix space,
    then (for most BPE vocabularies) clean_spaces.

    clean_spaces removes the space before "?!.,", around a lone "'" and before "'s 'm 're
    've". We decode without it: it would make the text of a token depend on the next one,
    which a stream cannot know when it emits it. So ours must equal llama.cpp's once the
    same cleaning is applied.
    """

    def __init__(self, metadata: Mapping[str, Any], pre_names: Mapping[str, Any]) -> None:
        self.tokens: list[str] = metadata["tokenizer.ggml.tokens"]
        self.types: list[int] = metadata.get("tokenizer.ggml.token_type") or []
        model = metadata["tokenizer.ggml.model"]
        self.sentencepiece = model == "llama"
        pre = "gemma4" if model == "gemma4" else metadata.get("tokenizer.ggml.pre", "default")
        flags = {} if self.sentencepiece else pre_names.get(pre, {})
        self.escape_whitespace = flags.get("escape_whitespaces", False)
        self.clean_spaces = not self.sentencepiece and flags.get("clean_spaces", True)
        prefix = metadata.get("tokenizer.ggml.add_space_prefix")
        self.remove_space = self.sentencepiece if prefix is None else bool(prefix)

    def piece(self, token: int) -> bytes:
        text, kind = self.tokens[token], self.types[token] if self.types else NORMAL
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            return text.encode()
        if kind == BYTE:
            return bytes([int(text[3:5], 16)])
        if kind != NORMAL:
            return b""
        if self.sentencepiece or self.escape_whitespace:
            return text.replace(SPACE_MARK, " ").encode()
        return bytes(BYTE_OF_CHAR[char] for char in text)  # llama_decode_text

    def __call__(self, ids: Sequence[int]) -> str:
        pieces = [self.piece(token) for token in ids]
        if pieces and self.remove_space and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        text = b"".join(pieces)
        return (clean_spaces(text) if self.clean_spaces else text).decode()

    def clean(self, text: str) -> str:
        return clean_spaces(text.encode()).decode() if self.clean_spaces else text


def clean_spaces(data: bytes) -> bytes:
    """The three passes of detokenize's clean_spaces, line by line (in place, as there)."""
    text = bytearray(data)
    space, quote = ord(" "), ord("'")
    end, total = len(text), min(len(text), 1)
    for i in range(1, end):
        x = text[i]
        if text[i - 1] == space and x in b"?!.,":  # " ?", " !", " .", " ,"
            total -= 1
        text[total] = x
        total += 1
    end, total, i = total, min(total, 1), 1
    while i < end:
        x = text[i]
        if x == quote and i + 1 < end and text[i - 1] == space and text[i + 1] == space:
            total -= 1  # " ' "
            i += 1
            text[i] = 0
        text[total] = x
        total += 1
        i += 1
    end, total = total, min(total, 1)
    for i in range(1, end):
        x = text[i]
        if text[i - 1] == space and x == quote and i + 1 < end:
            after = bytes(text[i + 1 : i + 3])
            if after[:1] in (b"s", b"m") or (i + 2 < end and after in (b"re", b"ve")):
                total -= 1  # " 's", " 'm", " 're", " 've"
        text[total] = x
        total += 1
    return bytes(text[:total])


def gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's spelling of bytes as characters, reversed (unicode_utf8_to_byte)."""
    shown = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    hidden = [byte for byte in range(256) if byte not in shown]
    return {chr(b): b for b in shown} | {chr(256 + n): b for n, b in enumerate(hidden)}


BYTE_OF_CHAR = gpt2_byte_alphabet()
