"""Fused decode steps (every layer in one C++ call) against eager ones on the real embedded
model's own GGUF blocks in float32: identical greedy ids over decode batches of every size,
every KV block back, and the fused path really taken."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.conftest import FP32, PROMPTS
from tests.model.test_step_graphs import staggered_run

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def loaded_gguf_fp32() -> LoadedModel:
    return LoadedModel.load(None, torch.float32, quantization="gguf-exact")


def test_fused_steps_give_eager_greedy_ids(loaded_gguf_fp32: LoadedModel) -> None:
    fused = LLMEngine(replace(FP32, max_num_seqs=4), loaded=loaded_gguf_fp32)
    eager = LLMEngine(replace(FP32, max_num_seqs=4, fused_decode=False), loaded=loaded_gguf_fp32)
    assert fused.runner.fused_decode is not None and eager.runner.fused_decode is None
    prompts = [fused.tokenizer.encode(text) for text in PROMPTS[:4]]
    got = staggered_run(fused, prompts)
    want = staggered_run(eager, prompts)
    assert got == want
    assert fused.runner.fused_decode.num_steps > 0
    stats = fused.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_fused_engine_compiles_no_graphs(loaded_gguf_fp32: LoadedModel) -> None:
    """The fused step takes any batch size, so a compiling engine has nothing to compile."""
    engine = LLMEngine(replace(FP32, enforce_eager=False, max_num_seqs=4), loaded=loaded_gguf_fp32)
    assert engine.runner.fused_decode is not None
    assert engine.runner.decode_graphs is None
