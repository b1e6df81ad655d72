"""Speculative decoding by prompt lookup on the embedded model (fp32): greedy output is the same
token for token with and without drafts, through every decode path (fused C++, eager), with
penalties and min_new_tokens counting the drafts before each verified row, and with stop ids
and length limits met exactly; drafts are proposed and accepted on a task that quotes its
context; sampled requests speculate too; every KV block is free afterwards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import pytest
import torch

from benchmarks.speculative_workload import grounded_messages
from services.contracts.sampling_params import MAX_SPECULATIVE_TOKENS, SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.scheduler.features.speculation_policy import SpeculationPolicy
from services.text.chat_template import ChatMessage
from services.worker.loaded_model import LoadedModel
from tests.model.conftest import PROMPTS


@pytest.fixture(scope="module")
def loaded_gguf() -> LoadedModel:
    """The GGUF blocks in fp32: what the fused C++ decode runs (and the default serving)."""
    return LoadedModel.load(None, torch.float32, quantization="gguf-exact")


class EveryDraft(SpeculationPolicy):
    """Grants every decode its full limit each step: the most drafts, and the most rejected
    ones, whatever the step times (the back-off itself is tests/unit's); so what is verified
    here does not depend on how fast this machine happens to be."""

    def draft_slots(
        self,
        decoding: Sequence[str],
        other_tokens: int = 0,
        caps: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        return {rid: (caps or {}).get(rid, self.max_draft_tokens) for rid in decoding}


def engine_for(loaded: LoadedModel, **config: object) -> LLMEngine:
    # speculation=True: drafts on whatever the weights (unset, a non-batch-invariant engine
    # such as gguf-exact's would give them only to requests that ask).
    settings: dict = {
        "kv_cache_gib": 64 / 1024,
        "seed": 0,
        "debug_checks": True,
        "speculation": True,
        **config,
    }
    engine = LLMEngine(EngineConfig(**settings), loaded=loaded)
    engine.scheduler.drafts.policy = EveryDraft(MAX_SPECULATIVE_TOKENS)
    return engine


def prompts(loaded: LoadedModel) -> list[list[int]]:
    quote = [
        ChatMessage(
            "user",
            "Repeat this sentence exactly: the mill by the river was "
            "rebuilt three times in a hundred years, and it still grinds rye.",
        )
    ]
    return [
        loaded.tokenizer.apply_chat_template(grounded_messages(1, seed=3)[0]),
        loaded.tokenizer.apply_chat_template(quote),
        *(loaded.tokenizer.encode(p) for p in PROMPTS[:2]),
    ]


def generate(engine: LLMEngine, ids: list[list[int]], **sampling: object) -> list[list[int]]:
    sampling.setdefault("max_new_tokens", 64)
    params = SamplingParams(temperature=0.0, **sampling)  # type: ignore[arg-type]
    results = engine.generate(ids, params)
    engine.scheduler.check_integrity()
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [r.token_ids for r in results]


@pytest.mark.parametrize("fused_decode", [True, False], ids=["fused", "eager"])
def test_greedy_output_is_the_same_with_drafts(
    loaded_gguf: LoadedModel, fused_decode: bool
) -> None:
    ids = prompts(loaded_gguf)
    plain = generate(
        engine_for(loaded_gguf, fused_decode=fused_decode, enforce_eager=True, speculation=False),
        ids,
    )
    engine = engine_for(
        loaded_gguf, fused_decode=fused_decode, enforce_eager=True, speculative_ngram=5
    )
    assert generate(engine, ids) == plain
    stats = engine.get_stats()
    assert stats.num_draft_tokens_accepted > 20, stats
    assert stats.num_draft_tokens_accepted < stats.num_draft_tokens_proposed
    if fused_decode:
        assert engine.runner.fused_decode is not None and engine.runner.fused_decode.num_steps > 0


@pytest.mark.parametrize(
    "sampling",
    [
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": 0.2},
        {"min_new_tokens": 40},
        {"stop_token_ids": (13,)},
        {"max_new_tokens": 33},
        {"logit_bias": ((30, -5.0), (260, 3.0))},
    ],
    ids=["penalties", "min_tokens", "stop_id", "max_tokens", "logit_bias"],
)
def test_sampling_options_see_the_drafts_before_each_row(
    loaded_gguf: LoadedModel, sampling: dict[str, object]
) -> None:
    ids = prompts(loaded_gguf)[:3]
    plain = generate(engine_for(loaded_gguf, speculation=False), ids, **sampling)
    engine = engine_for(loaded_gguf)
    assert generate(engine, ids, num_speculative_tokens=6, **sampling) == plain
    assert engine.get_stats().num_draft_tokens_proposed > 0


def test_a_batch_mixing_drafting_and_plain_sequences_keeps_each_output(
    loaded_gguf: LoadedModel,
) -> None:
    """Sequences with drafts share steps with sequences without (logprobs cannot draft) and
    with prefills arriving late; each one's greedy output is its output alone."""
    ids = prompts(loaded_gguf)
    alone = generate(engine_for(loaded_gguf, speculation=False), ids)
    engine = engine_for(loaded_gguf, speculative_ngram=4, max_num_batched_tokens=128)
    request_ids = []
    for index, prompt in enumerate(ids):
        params = SamplingParams(temperature=0.0, max_new_tokens=64, logprobs=index % 2)
        request_ids.append(engine.add_request(prompt, params))
    outputs: dict[str, list[int]] = {rid: [] for rid in request_ids}
    for event in engine.stream():
        outputs[event.request_id].extend(event.new_token_ids)
    assert [outputs[rid] for rid in request_ids] == alone
    assert engine.get_stats().num_draft_tokens_accepted > 0
    engine.scheduler.check_integrity()


def test_sampled_requests_speculate_and_finish(loaded_gguf: LoadedModel) -> None:
    """Temperature > 0 (unseeded) verifies drafts by the rejection rule; its exactness is
    tests/unit/test_draft_verification.py's statistical test, here it runs end to end."""
    engine = engine_for(loaded_gguf, speculative_ngram=5, seed=None)
    ids = prompts(loaded_gguf)[:2]
    params = SamplingParams(temperature=0.3, top_p=0.9, max_new_tokens=64, ignore_eos=True)
    results = engine.generate(ids, params)
    assert all(len(r.token_ids) == 64 for r in results)
    stats = engine.get_stats()
    assert stats.num_draft_tokens_proposed > 0 and stats.num_draft_tokens_accepted > 0
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_seeded_worker_repeats_its_samples_so_sampled_requests_do_not_draft(
    loaded_gguf: LoadedModel,
) -> None:
    """With --seed, unseeded sampled requests draw from the worker's seeded generator: the
    same requests on the same config give the same samples, which drafts granted by measured
    step times would break, so they do not draft there (greedy ones still do)."""
    ids = prompts(loaded_gguf)[:2]
    sampled = SamplingParams(temperature=0.8, max_new_tokens=32, ignore_eos=True)
    runs = []
    for _ in range(2):
        engine = engine_for(loaded_gguf, seed=0)
        runs.append([r.token_ids for r in engine.generate(ids, sampled)])
        assert engine.get_stats().num_draft_tokens_proposed == 0
        generate(engine, ids)  # greedy
        assert engine.get_stats().num_draft_tokens_proposed > 0
    assert runs[0] == runs[1]
