"""Shared, expensive fixtures for model tests: the embedded model loaded by our engine and by
Hugging Face transformers (the reference), both in fp32."""

from __future__ import annotations

import pytest
import torch

from services.common.model_source import embedded_model_path
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three colors:\n1.",
    "Water boils at a temperature of",
    "The quick brown fox",
    "In 1969, the first human landed on the",
    "Translate to French: 'good morning' ->",
    "Emoji test 😀 and accents: café, naïve, 東京.",
]


# Eager steps: most model tests are about the engine's logic; tests/model/test_step_graphs.py
# holds compiled steps to the eager ones.
FP32 = EngineConfig(
    dtype="float32", kv_cache_gib=256 / 1024, seed=0, enforce_eager=True, debug_checks=True
)


@pytest.fixture(scope="session")
def loaded_fp32() -> LoadedModel:
    return LoadedModel.load(None, torch.float32)


@pytest.fixture(scope="session")
def engine(loaded_fp32: LoadedModel) -> LLMEngine:
    return LLMEngine(FP32, loaded=loaded_fp32)


@pytest.fixture(scope="session")
def hf_model():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    path = embedded_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
