"""Suffix decoding on the embedded model: greedy output is token for token the same with prompt
lookup alone, with the suffix cache and without speculation, in exact mode (gguf-exact) and the
default weights, while several requests share the cache (a second round drafts from the
first's outputs); and on the runner, a tenant's (cache salt's) text never drafts another's."""

from __future__ import annotations

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.test_speculative_decoding import engine_for, prompts

SUFFIX = {"speculative_suffix_cache_tokens": 8192}


@pytest.fixture(scope="module", params=["gguf-exact", "default"])
def loaded(request: pytest.FixtureRequest) -> LoadedModel:
    if request.param == "default":
        return LoadedModel.load(None, torch.float32)
    return LoadedModel.load(None, torch.float32, quantization=request.param)


def two_rounds(engine: LLMEngine, ids: list[list[int]]) -> list[list[int]]:
    """Every prompt twice, in two batches: the second drafts from the first's text."""
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    outputs = []
    for _ in range(2):
        outputs.extend(r.token_ids for r in engine.generate(ids, params))
        engine.scheduler.check_integrity()
        stats = engine.get_stats()
        assert stats.num_free_blocks == stats.num_total_blocks
    return outputs


def test_greedy_output_is_the_same_with_the_suffix_cache(loaded: LoadedModel) -> None:
    ids = prompts(loaded)
    plain = two_rounds(engine_for(loaded, speculation=False), ids)
    ngram = engine_for(loaded, speculative_ngram=5, speculative_suffix_cache_tokens=0)
    assert two_rounds(ngram, ids) == plain
    suffix = engine_for(loaded, speculative_ngram=5, **SUFFIX)
    assert two_rounds(suffix, ids) == plain
    cache = suffix.runner.suffix_cache
    assert cache is not None and len(cache) == 2 * len(ids)
    cache.check_integrity()
    # The repeated round is drafted from the first one's outputs: far more is accepted than
    # the sequences' own contexts offer.
    accepted_suffix = suffix.get_stats().num_draft_tokens_accepted
    accepted_ngram = ngram.get_stats().num_draft_tokens_accepted
    assert accepted_suffix > accepted_ngram + 40, (accepted_suffix, accepted_ngram)


def test_a_tenants_text_never_drafts_another_tenants_tokens(loaded: LoadedModel) -> None:
    """On the worker's runner, plans by hand: after tenant A's request is served, tenant B's
    request (the same prompt) drafts exactly what it drafts on a fresh worker (its own
    context), while A's second request drafts far more (A's first answer)."""

    def serve(engine: LLMEngine, request_id: str, salt: bytes, steps: int) -> list[int]:
        """Prefill, then `steps` decodes with 8 draft slots each; the drafts proposed."""
        runner = engine.runner
        prompt = prompts(loaded)[1]
        num_blocks = (len(prompt) + 9 * (steps + 1)) // runner.kv_cache.spec.block_size + 1
        sampling = SamplingParams(temperature=0.0, max_new_tokens=64)
        seq = NewSequence(
            request_id,
            list(prompt),
            len(prompt),
            list(range(1, num_blocks + 1)),
            0,
            sampling,
            cache_salt=salt,
        )
        runner.execute(
            BatchPlan(0, new_sequences=[seq], num_scheduled_tokens={request_id: len(prompt)})
        )
        drafted = []
        for step in range(1, steps + 1):
            plan = BatchPlan(
                step, num_scheduled_tokens={request_id: 1}, draft_slots={request_id: 8}
            )
            drafted.append(runner.execute(plan).num_proposed_drafts.get(request_id, 0))
        runner.execute(BatchPlan(steps + 1, finished_request_ids=[request_id]))
        return drafted

    shared = engine_for(loaded, **SUFFIX)
    serve(shared, "a1", b"tenant-a", 12)
    other_tenant = serve(shared, "b1", b"tenant-b", 6)
    same_tenant = serve(shared, "a2", b"tenant-a", 6)
    fresh = serve(engine_for(loaded, **SUFFIX), "b1", b"tenant-b", 6)
    assert other_tenant == fresh
    assert sum(same_tenant) > sum(fresh) + 6, (same_tenant, fresh)
