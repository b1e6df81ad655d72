"""The KV disk tier on the embedded model (float32): greedy ids are the same whether a prefix is
computed, found in the pool, or loaded from disk by a restarted engine on the same directory,
which counts the loaded blocks as cached tokens."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from services.contracts.sampling_params import SamplingParams
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.conftest import FP32

BLOCK_SIZE = FP32.block_size
PROMPT = [100 + (7 * i) % 900 for i in range(5 * BLOCK_SIZE + 3)]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)


def run(engine: LLMEngine) -> tuple[list[int], int]:
    (result,) = engine.generate([PROMPT], GREEDY)
    return result.token_ids, result.usage.cached_prompt_tokens


def test_a_restarted_engine_serves_the_prefix_from_disk(
    loaded_fp32: LoadedModel, tmp_path: Path
) -> None:
    config = dataclasses.replace(FP32, kv_disk_dir=str(tmp_path))
    first = LLMEngine(config, loaded=loaded_fp32)
    computed, cached = run(first)
    assert cached == 0
    from_pool, cached = run(first)
    assert cached == 5 * BLOCK_SIZE
    assert from_pool == computed
    assert first.runner.kv_disk is not None
    first.runner.kv_disk.close()  # a graceful stop writes what is pending
    assert len(list(tmp_path.glob("[0-9a-f]*"))) == 5  # one file per block (and the lock)

    restarted = LLMEngine(config, loaded=loaded_fp32)  # an empty pool, the same directory
    assert restarted.scheduler.disk is not None
    from_disk, cached = run(restarted)
    assert cached == 5 * BLOCK_SIZE
    assert from_disk == computed

    without_tier = LLMEngine(FP32, loaded=loaded_fp32)
    assert run(without_tier) == (computed, 0)


def test_exact_gguf_blocks_from_disk_match_computed(tmp_path: Path) -> None:
    loaded = LoadedModel.load(None, torch.float32, "cpu", "gguf-exact")
    config = dataclasses.replace(FP32, kv_disk_dir=str(tmp_path), quantization="gguf-exact")
    first = LLMEngine(config, loaded=loaded)
    computed, _ = run(first)
    assert first.runner.kv_disk is not None
    first.runner.kv_disk.close()
    from_disk, cached = run(LLMEngine(config, loaded=loaded))
    assert (from_disk, cached) == (computed, 5 * BLOCK_SIZE)
    # another weight format computes other KV: its engine refuses (deletes) these files
    other = dataclasses.replace(FP32, kv_disk_dir=str(tmp_path))
    _, cached = run(LLMEngine(other, loaded=LoadedModel.load(None, torch.float32)))
    assert cached == 0
