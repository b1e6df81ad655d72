"""The tiny models of every family: transformers loads and runs each directory, llama.cpp's
converter accepts it, and llama-quantize's files hold the types each kind promises.

Everything is cached ($LLMSERVE_CACHE_DIR/tiny-models, llama-quantize beside the bench's tools),
so a second run only reads files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.model.gguf_convert import (
    QUANT_KINDS,
    ConversionRefused,
    read_metadata,
    read_tensors,
    timed_quantize_binary,
    tiny_gguf,
)
from tests.model.tiny_models import FAMILIES, tiny_model_dir
from tests.model.tiny_tokenizers import BpeRecipe, SpmRecipe

pytestmark = pytest.mark.slow

# Families the converter declines, with the words its refusal must contain. None today: the
# byte-level BPE families carry real vocabularies whose pre-tokenizer hash it knows.
EXPECTED_REFUSALS: dict[str, str] = {}

GGUF_ARCHITECTURES = {
    "llama": "llama",
    "llama-yarn": "llama",
    "mistral": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma": "gemma",
    "gemma2": "gemma2",
    "gemma3": "gemma3",
    "phi3": "phi3",
    "phi4-mini": "phi3",
    "olmo2": "olmo2",
    "granite": "granite",
    "smollm3": "smollm3",
}

# Per kind: the types its 2-D weights may take (llama-quantize's mixes give some tensors more
# bits: token_embd / output, attn_v and ffn_down in some layers) and the ones that must appear.
QUANT_TYPES = {
    "Q4_K_M": ({"Q4_K", "Q6_K"}, {"Q4_K", "Q6_K"}),
    "Q6_K": ({"Q6_K"}, {"Q6_K"}),
    "Q5_K_M": ({"Q5_K", "Q6_K"}, {"Q5_K", "Q6_K"}),
    "Q4_0": ({"Q4_0", "Q6_K"}, {"Q4_0"}),
    "IQ4_NL": ({"IQ4_NL", "Q6_K"}, {"IQ4_NL"}),
}

# Longer than the sliding windows (32) of Mistral and Gemma 2 / 3.
PROMPT = " ".join(
    ["The quick brown fox jumps over the lazy dog near the river, and the city sleeps."] * 6
)

FAMILY_NAMES = list(FAMILIES)


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    return {}


def model_dir(family: str, cache: dict[str, Path]) -> Path:
    from benchmarks.llamacpp_build import PeerBuildError

    if family not in cache:
        try:
            cache[family] = tiny_model_dir(family)
        except PeerBuildError as exc:  # BPE families read llama.cpp's vocabulary files
            pytest.skip(f"llama.cpp sources unavailable: {exc}")
    return cache[family]


@pytest.fixture(scope="session")
def quantize_tool(request: pytest.FixtureRequest) -> Path:
    from benchmarks.llamacpp_build import PeerBuildError

    try:
        binary, build_s = timed_quantize_binary()
    except PeerBuildError as exc:
        pytest.skip(f"llama-quantize could not be built: {exc}")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        took = "already built" if build_s is None else f"built in {build_s:.0f} s"
        reporter.write_line(f"llama-quantize: {binary} ({took})")
    return binary


def gguf_or_refusal(family: str, kind: str, model_dirs: dict[str, Path]) -> Path | None:
    """The family's GGUF file, or None after checking an expected refusal."""
    from benchmarks.llamacpp_build import PeerBuildError

    model_dir(family, model_dirs)
    try:
        path = tiny_gguf(family, kind)
    except ConversionRefused as refused:
        expected = EXPECTED_REFUSALS.get(family)
        assert expected is not None, f"{family}: {refused.reason}\n{refused.log[-3000:]}"
        assert expected in refused.reason
        return None
    except PeerBuildError as exc:
        pytest.skip(f"llama.cpp sources unavailable: {exc}")
    assert family not in EXPECTED_REFUSALS, f"{family} converts now: update EXPECTED_REFUSALS"
    return path


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_transformers_loads_and_generates(family: str, model_dirs: dict[str, Path]) -> None:
    import transformers

    directory = model_dir(family, model_dirs)
    spec = FAMILIES[family]
    config = json.loads((directory / "config.json").read_text())
    assert config["torch_dtype" if "torch_dtype" in config else "dtype"] == "float32"
    for key, value in spec.config.items():
        if key != "rope_parameters":
            assert config[key] == value, key
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=torch.float32)
    assert type(model).__name__ == spec.model_class

    if isinstance(spec.tokenizer, SpmRecipe):
        import sentencepiece

        processor = sentencepiece.SentencePieceProcessor(
            model_file=str(directory / "tokenizer.model")
        )
        text = "Hello World! café 東京 ✅ 2024\n  two  spaces"
        assert tokenizer(text, add_special_tokens=False).input_ids == processor.encode(text)
    if spec.chat_template is not None:
        messages = [{"role": "user", "content": PROMPT}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        input_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    else:
        input_ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    assert input_ids.shape[1] > 64
    with torch.no_grad():
        output = model.generate(input_ids, max_new_tokens=8, do_sample=False)
    assert output.shape == (1, input_ids.shape[1] + 8)
    assert int(output.max()) < config["vocab_size"]


def converter_cases() -> list[tuple[str, str]]:
    """f32 for every family; the converter's q8_0 (a second conversion: the slow half of a
    fresh run) for the families the parity tests serve it on, or all when asked."""
    full = os.environ.get("LLMSERVE_FULL_GGUF_MATRIX") == "1"
    return [
        (family, kind)
        for family in FAMILY_NAMES
        for kind in ("f32", "q8_0")
        if full or kind == "f32" or family in ("llama", "gemma3")
    ]


@pytest.mark.parametrize(("family", "kind"), converter_cases())
def test_converter_accepts(family: str, kind: str, model_dirs: dict[str, Path]) -> None:
    path = gguf_or_refusal(family, kind, model_dirs)
    if path is None:
        return
    spec = FAMILIES[family]
    metadata = read_metadata(path, "general.architecture", "tokenizer.ggml.pre")
    assert metadata["general.architecture"] == GGUF_ARCHITECTURES[family]
    expected_pre = "default"  # SentencePiece
    if isinstance(spec.tokenizer, BpeRecipe):
        expected_pre = spec.tokenizer.expected_pre
    assert metadata["tokenizer.ggml.pre"] == expected_pre
    tensors = read_tensors(path)
    matrices = {name: info.type_name for name, info in tensors.items() if len(info.shape) > 1}
    vectors = {name: info.type_name for name, info in tensors.items() if len(info.shape) == 1}
    assert set(vectors.values()) == {"F32"}
    assert set(matrices.values()) == {kind.upper()}, matrices


# The formats the parity tests serve, on every run; the others with LLMSERVE_FULL_GGUF_MATRIX=1
# (each is a llama-quantize run per family: minutes on a fresh machine).
CHECKED_KINDS = (
    QUANT_KINDS
    if os.environ.get("LLMSERVE_FULL_GGUF_MATRIX") == "1"
    else tuple(k for k in QUANT_KINDS if k in ("Q4_K_M", "Q6_K"))
)


@pytest.mark.parametrize("kind", CHECKED_KINDS)
@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_quantized_types(
    family: str, kind: str, model_dirs: dict[str, Path], quantize_tool: Path
) -> None:
    path = gguf_or_refusal(family, kind, model_dirs)
    if path is None:
        return
    allowed, required = QUANT_TYPES[kind]
    tensors = read_tensors(path)
    matrices = {name: info.type_name for name, info in tensors.items() if len(info.shape) > 1}
    # Every row is a multiple of 256 values, so no tensor falls back to a smaller block type.
    assert all(info.shape[0] % 256 == 0 for info in tensors.values() if len(info.shape) > 1)
    assert set(matrices.values()) <= allowed, matrices
    assert required <= set(matrices.values()), matrices
    assert {info.type_name for info in tensors.values() if len(info.shape) == 1} == {"F32"}
    if kind == "Q4_K_M":  # once per family (10 to 30 s on a large vocabulary): gguf's reader
        import gguf

        reader = gguf.GGUFReader(path)
        assert {t.name: t.tensor_type.name for t in reader.tensors} == {
            name: info.type_name for name, info in tensors.items()
        }
