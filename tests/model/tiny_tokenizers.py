"""Tokenizers for the tiny test models, made offline in the shape of each family's real one, so
that both transformers and llama.cpp's convert_hf_to_gguf.py read them.

Two kinds, because the converter reads them two ways:

- SentencePiece families (Mistral, Gemma, Phi-3) ship `tokenizer.model`; the converter reads its
  pieces and scores directly, so a SentencePiece BPE model trained here on a fixed text (about a
  thousand pieces, byte fallback) is accepted whatever its vocabulary.
- Byte-level BPE families (Llama 3, Qwen, OLMo 2, Granite, SmolLM3) are named by a hash: the
  converter encodes a fixed test text and looks the sha256 of the token ids up in a table of
  known tokenizers (`get_vocab_base_pre`). A tokenizer trained here would be refused. So these
  use a real vocabulary and merges from the `models/ggml-vocab-*.gguf` files that llama.cpp's
  sources ship, with the pre-tokenizer of the model that produced the hash. The hash covers
  ids as high as 150k (and the BOS id), so no truncation to a few thousand tokens keeps it:
  these vocabularies are full size (49k to 152k tokens).
"""

from __future__ import annotations

import io
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from tests.model.gguf_header import read_gguf_header

SPM_VOCAB_SIZE = 1000
# Pre-tokenizer patterns, as in the families' own tokenizer.json files.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True, slots=True)
class SpmRecipe:
    """A SentencePiece BPE model trained on `training_text()`.

    layout "llama": <unk> 0, <s> 1, </s> 2, a space is prepended (Llama 2, Mistral, Phi-3).
    layout "gemma": <pad> 0, <eos> 1, <bos> 2, <unk> 3, no space prepended, and the chat tokens
    at Gemma's own ids (<start_of_turn> 106, <end_of_turn> 107: the Gemma converter hard-codes
    107 as end-of-turn)."""

    layout: str
    tokenizer_class: str
    # Special tokens appended after the SentencePiece vocabulary (Phi-3's <|user|> ...).
    added_special_tokens: tuple[str, ...] = ()
    eos_token: str | None = None  # default: the layout's own


@dataclass(frozen=True, slots=True)
class BpeRecipe:
    """A byte-level BPE vocabulary taken from llama.cpp's `models/ggml-vocab-{vocab}.gguf`."""

    vocab: str
    pre_tokenizer: str  # "llama3" | "qwen2" | "digits" (StarCoder: single digits, then bytes)
    tokenizer_class: str
    bos_token: str | None
    eos_token: str
    add_bos_token: bool
    pad_token: str | None = None
    nfc: bool = False
    ignore_merges: bool = False
    # Keep only ids below this (cl100k is the first 100256 tokens of Llama 3's vocabulary).
    num_base_tokens: int | None = None
    # Special tokens renamed or added at fixed ids: id -> text.
    special_tokens: dict[int, str] = field(default_factory=dict)
    # The converter's name for this pre-tokenizer: the test text must hash to it.
    expected_pre: str = ""


TokenizerRecipe = SpmRecipe | BpeRecipe


def training_text(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """A fixed, generated English-like text with every printable ASCII character, digits and a
    few non-Latin words, so that the trained pieces cover ordinary prompts."""
    words = (  # noqa: SIM905 (one word list reads better as text)
        "the of and to in is was for on that with as by at from his it an were are which this be "
        "has or had first one their its new after but who not they have her she two been other "
        "when there all during into school time may years more most only over city some world "
        "would where later up such used many can state about national out known university "
        "united then made model token server request cache block batch prompt answer question "
        "river mountain capital France Paris London water boils degrees quick brown fox jumps "
        "lazy dog once upon village colors red green blue yellow translate morning evening "
        "function return value list three four five seven eight nine hundred thousand million "
        "café naïve déjà über straße Москва привет 東京 你好 こんにちは"
    ).split()
    symbols = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~")
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        parts = []
        for _ in range(rng.randint(6, 16)):
            word = rng.choice(words)
            roll = rng.random()
            if roll < 0.1:
                word = word.capitalize()
            elif roll < 0.15:
                word = word.upper()
            elif roll < 0.25:
                word = str(rng.randint(0, 100000))
            elif roll < 0.3:
                word = word + rng.choice(symbols)
            parts.append(word)
        lines.append(" ".join(parts) + rng.choice([".", "?", "!", ":", ";", ""]))
    return lines


def gemma_user_symbols() -> list[str]:
    """Gemma's added pieces in its id order, from id 4 (after pad, eos, bos, unk) to 107."""
    symbols = [f"<unused{index}>" for index in range(4, 108)]
    fixed = {
        4: "<mask>",
        5: "[@BOS@]",
        67: "<|fim_prefix|>",
        68: "<|fim_middle|>",
        69: "<|fim_suffix|>",
        70: "<|file_separator|>",
        106: "<start_of_turn>",
        107: "<end_of_turn>",
    }
    for token_id, text in fixed.items():
        symbols[token_id - 4] = text
    return symbols


def train_sentencepiece(recipe: SpmRecipe, path: Path) -> None:
    import sentencepiece as spm

    if recipe.layout == "llama":
        ids = {"unk_id": 0, "bos_id": 1, "eos_id": 2, "pad_id": -1}
        layout: dict[str, object] = {"add_dummy_prefix": True}
    elif recipe.layout == "gemma":
        ids = {"pad_id": 0, "eos_id": 1, "bos_id": 2, "unk_id": 3}
        layout = {
            "add_dummy_prefix": False,
            "pad_piece": "<pad>",
            "eos_piece": "<eos>",
            "bos_piece": "<bos>",
            "user_defined_symbols": gemma_user_symbols(),
        }
    else:
        raise ValueError(f"layout: unknown SentencePiece layout {recipe.layout!r}")
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_text()),
        model_writer=model,
        model_type="bpe",
        vocab_size=SPM_VOCAB_SIZE,
        byte_fallback=True,
        split_digits=True,
        character_coverage=1.0,
        remove_extra_whitespaces=False,
        normalization_rule_name="identity",
        num_threads=1,  # the merges do not depend on thread timing
        minloglevel=2,
        **ids,
        **layout,
    )
    path.write_bytes(model.getvalue())


def save_spm_tokenizer(recipe: SpmRecipe, directory: Path, chat_template: str | None) -> int:
    """tokenizer.model, tokenizer.json and tokenizer_config.json; returns the vocabulary size
    (SentencePiece pieces plus added special tokens)."""
    import transformers

    train_sentencepiece(recipe, directory / "tokenizer.model")
    tokenizer_class = getattr(transformers, recipe.tokenizer_class)
    # transformers converts tokenizer.model into its fast tokenizer (tokenizer.json).
    tokenizer = tokenizer_class.from_pretrained(str(directory), add_bos_token=True)
    if recipe.added_special_tokens:
        tokenizer.add_special_tokens(
            {"additional_special_tokens": list(recipe.added_special_tokens)},
            replace_extra_special_tokens=False,
        )
    if recipe.eos_token is not None:
        tokenizer.eos_token = recipe.eos_token
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    write_added_tokens_decoder(directory, special_texts=special_token_texts(recipe))
    return len(tokenizer)


def special_token_texts(recipe: SpmRecipe) -> set[str]:
    base = {"<unk>", "<s>", "</s>"} if recipe.layout == "llama" else {"<pad>", "<eos>", "<bos>"}
    if recipe.layout == "gemma":
        base |= {"<unk>", "<mask>", "[@BOS@]", "<start_of_turn>", "<end_of_turn>"}
    return base | set(recipe.added_special_tokens)


def write_added_tokens_decoder(directory: Path, special_texts: set[str]) -> None:
    """Hugging Face repos list their added tokens in tokenizer_config.json (transformers 5 keeps
    them only in tokenizer.json); llama.cpp's SentencePiece path reads them there to mark
    control tokens."""
    tokenizer_json = json.loads((directory / "tokenizer.json").read_text())
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    decoder = {}
    for token in tokenizer_json["added_tokens"]:
        decoder[str(token["id"])] = {
            "content": token["content"],
            "lstrip": token["lstrip"],
            "normalized": token["normalized"],
            "rstrip": token["rstrip"],
            "single_word": token["single_word"],
            "special": token["content"] in special_texts,
        }
    config["added_tokens_decoder"] = decoder
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


@dataclass(frozen=True, slots=True)
class GgufVocab:
    tokens: list[str]
    token_types: list[int]
    merges: list[str]


def read_gguf_vocab(path: Path) -> GgufVocab:
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    metadata = read_gguf_header(path, array_keys=keys).metadata
    tokens, token_types, merges = (metadata[key] for key in keys)
    assert isinstance(tokens, list) and isinstance(token_types, list) and isinstance(merges, list)
    return GgufVocab(tokens, token_types, merges)


GGUF_TOKEN_CONTROL = 3
# The converter fills unused ids with "[PAD<id>]"; it makes them again from the config.
PADDING_TOKEN = re.compile(r"\[PAD\d+\]")


def bpe_backend(recipe: BpeRecipe, vocab_file: Path):  # type: ignore[no-untyped-def]
    """The `tokenizers` object: the gguf's tokens below `num_base_tokens` with their ids, its
    control tokens and the recipe's own as special tokens. Special tokens stay in the BPE
    vocabulary (as in StarCoder's tokenizer.json) so that adding them keeps their ids."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers as pre

    source = read_gguf_vocab(vocab_file)
    limit = recipe.num_base_tokens or len(source.tokens)
    kept = [
        (token_id, text, kind)
        for token_id, (text, kind) in enumerate(zip(source.tokens, source.token_types, strict=True))
        if token_id < limit and not PADDING_TOKEN.fullmatch(text)
    ]
    text_by_id = {token_id: text for token_id, text, _ in kept}
    added = {token_id: kind == GGUF_TOKEN_CONTROL for token_id, _, kind in kept if kind != 1}
    added.update({token_id: True for token_id in recipe.special_tokens})
    text_by_id.update(recipe.special_tokens)
    vocab = {text: token_id for token_id, text in text_by_id.items()}
    merges = []
    for merge in source.merges:
        left, right = merge.split(" ", 1)
        # A merge whose parts or result fell outside the kept ids would never fire anyway.
        if left in vocab and right in vocab and left + right in vocab:
            merges.append((left, right))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=recipe.ignore_merges))
    if recipe.nfc:
        backend.normalizer = normalizers.NFC()
    if recipe.pre_tokenizer == "digits":
        backend.pre_tokenizer = pre.Sequence(
            [pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)]
        )
    else:
        pattern = {"llama3": LLAMA3_PATTERN, "qwen2": QWEN2_PATTERN}[recipe.pre_tokenizer]
        backend.pre_tokenizer = pre.Sequence(
            [
                pre.Split(Regex(pattern), behavior="isolated"),
                pre.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    # In id order: each is already in the vocabulary, so it keeps its id.
    backend.add_tokens(
        [
            AddedToken(text_by_id[token_id], special=special, normalized=False)
            for token_id, special in sorted(added.items())
        ]
    )
    for token_id in added:
        assert backend.token_to_id(text_by_id[token_id]) == token_id, f"lost id {token_id}"
    return backend


def save_bpe_tokenizer(
    recipe: BpeRecipe, directory: Path, chat_template: str | None, vocab_dir: Path
) -> int:
    """tokenizer.json and tokenizer_config.json; returns the largest id plus one."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = bpe_backend(recipe, vocab_dir / f"ggml-vocab-{recipe.vocab}.gguf")
    if recipe.add_bos_token:
        assert recipe.bos_token is not None
        bos_id = backend.token_to_id(recipe.bos_token)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{recipe.bos_token} $A",
            pair=f"{recipe.bos_token} $A {recipe.bos_token} $B",
            special_tokens=[(recipe.bos_token, bos_id)],
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=recipe.bos_token,
        eos_token=recipe.eos_token,
        pad_token=recipe.pad_token,
        clean_up_tokenization_spaces=False,
    )
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(str(directory))
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = recipe.tokenizer_class
    config["add_bos_token"] = recipe.add_bos_token
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    return max(backend.get_vocab(with_added_tokens=True).values()) + 1
