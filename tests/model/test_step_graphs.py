"""Compiled decode steps against eager ones on the real embedded model in float32: identical
greedy ids at every bucket size, padding rows that touch no KV block, and the buckets really
replayed (not an eager fallback)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.contracts.sampling_params import SamplingParams
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from services.worker.step_graphs import buckets_up_to
from tests.model.conftest import FP32, PROMPTS

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=20, ignore_eos=True)
# Buckets 1, 2 and 4: batches of 1, 2 and 3 sequences (3 pads one row) all occur below.
MAX_NUM_SEQS = 4


@pytest.fixture(scope="module")
def compiled_engine(loaded_fp32: LoadedModel) -> LLMEngine:
    return LLMEngine(
        replace(FP32, enforce_eager=False, fused_decode=False, max_num_seqs=MAX_NUM_SEQS),
        loaded=loaded_fp32,
    )


def staggered_run(engine: LLMEngine, prompts: list[list[int]]) -> dict[int, list[int]]:
    """One new request every third step, so decode batches of every size up to 3 occur."""
    outputs: dict[str, list[int]] = {}
    order: dict[str, int] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:
            index, prompt = pending.pop(0)
            sampling = replace(GREEDY, max_new_tokens=GREEDY.max_new_tokens - 2 * index)
            order[engine.add_request(prompt, sampling)] = index
        for event in engine.step():
            outputs.setdefault(event.request_id, []).extend(event.new_token_ids)
        step += 1
    return {order[rid]: ids for rid, ids in outputs.items()}


def test_buckets_cover_the_batch_limit() -> None:
    assert buckets_up_to(4) == [1, 2, 4]
    assert buckets_up_to(5) == [1, 2, 4, 8]
    assert buckets_up_to(128) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert buckets_up_to(1000) == [1, 2, 4, 8, 16, 32, 64, 128]


def test_compiled_steps_give_eager_greedy_ids(
    compiled_engine: LLMEngine, loaded_fp32: LoadedModel
) -> None:
    eager = LLMEngine(replace(FP32, max_num_seqs=MAX_NUM_SEQS), loaded=loaded_fp32)
    prompts = [compiled_engine.tokenizer.encode(text) for text in PROMPTS[:3]]
    graphs = compiled_engine.runner.decode_graphs
    assert graphs is not None and graphs.is_compiled
    before = dict(graphs.num_replays)
    got = staggered_run(compiled_engine, prompts)
    want = staggered_run(eager, prompts)
    assert got == want
    replayed = {b: graphs.num_replays[b] - before[b] for b in graphs.buckets}
    assert all(count > 0 for count in replayed.values()), replayed
    # Every block back, none leaked by the padded rows.
    stats = compiled_engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_padding_rows_write_no_kv(compiled_engine: LLMEngine) -> None:
    """A batch of 3 in the bucket of 4: the cache changes only in the 3 real rows' slots."""
    engine = compiled_engine
    prompts = [engine.tokenizer.encode(text) for text in PROMPTS[3:6]]
    for prompt in prompts:
        engine.add_request(prompt, replace(GREEDY, max_new_tokens=4))
    engine.step()  # the three prefills
    graphs = engine.runner.decode_graphs
    assert graphs is not None
    before_replays = graphs.num_replays[4]
    before = engine.kv_cache.storage.clone()
    engine.step()  # one decode step of 3 sequences
    assert graphs.num_replays[4] == before_replays + 1
    changed = (engine.kv_cache.storage != before).flatten(3).any(-1)  # [layer, K|V, block]
    changed_blocks = changed.any(0).any(0).nonzero().flatten().tolist()
    running = list(engine.runner.batch.sequences.values())
    last_blocks = {seq.block_ids[(seq.num_computed_tokens - 1) // 16] for seq in running}
    assert set(changed_blocks) <= last_blocks
    while engine.has_unfinished_requests():
        engine.step()


def test_eager_engine_compiles_nothing(loaded_fp32: LoadedModel) -> None:
    engine = LLMEngine(FP32, loaded=loaded_fp32)
    assert engine.runner.decode_graphs is None
    result = engine.generate([[1, 2, 3]], replace(GREEDY, max_new_tokens=2))[0]
    assert len(result.token_ids) == 2
