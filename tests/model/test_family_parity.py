"""Every registered family against transformers on the same weights, in float32: the last
position's logits and 32 greedy tokens, with prompts longer than any sliding window, chunked
prefill (a step budget smaller than the prompts), a prefix-cache hit, and decode steps on the
fused C++ step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.random_hf_models import (
    FAMILY_SPECS,
    VOCAB_SIZE,
    build_random_hf_model,
    load_hf_reference,
)
from tests.model.test_hf_parity import our_last_logits

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
PROMPT_LENS = (97, 70, 45)
SHARED_PREFIX = 64  # the prefix-cache probe reuses this much of the first prompt
# A step budget below every prompt, so each prefill runs in chunks.
CHUNKED = EngineConfig(
    dtype="float32",
    kv_cache_gib=32 / 1024,
    seed=0,
    enforce_eager=True,
    max_num_batched_tokens=40,
    block_size=16,
)


@pytest.fixture(scope="module", params=sorted(FAMILY_SPECS))
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    name = request.param
    return build_random_hf_model(name, tmp_path_factory.mktemp(name))


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return ids


def hf_greedy(hf_model, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(ids) :].tolist())


def test_logits_and_greedy_tokens_match_transformers(family_dir: Path) -> None:
    hf_model = load_hf_reference(family_dir)
    loaded = LoadedModel.load(str(family_dir), torch.float32)
    engine = LLMEngine(CHUNKED, loaded=loaded)
    batch = prompts()

    for ids in batch:
        ours = our_last_logits(engine, ids)
        with torch.inference_mode():
            theirs = hf_model(torch.tensor([ids])).logits[0, -1].float()
        scale = max(1.0, theirs.abs().max().item())
        diff = (ours - theirs).abs().max().item()
        assert diff < 1e-4 * scale, f"max abs logit diff {diff} (scale {scale})"

    greedy = SamplingParams(temperature=0.0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    results = engine.generate(batch, greedy)  # batched, chunked prefill
    for ids, result in zip(batch, results, strict=True):
        assert result.token_ids == hf_greedy(hf_model, ids)
    # Every family's decode steps run the fused C++ step (services/worker/fused_decode.py).
    fused = engine.runner.fused_decode
    assert fused is not None and fused.num_steps > 0

    # The first prompt's blocks are cached now: this one starts from a prefix-cache hit.
    probe = [*batch[0][:SHARED_PREFIX], *batch[1][:30]]
    hits_before = engine.get_stats().prefix_hit_tokens
    (result,) = engine.generate([probe], greedy)
    assert engine.get_stats().prefix_hit_tokens >= SHARED_PREFIX - CHUNKED.block_size + hits_before
    assert result.token_ids == hf_greedy(hf_model, probe)
