"""logit_bias and allowed_token_ids in the in-process engine on the embedded model, through
every decode path: eager steps, and the fused C++ decode of GGUF blocks in float32 (whose
logits must still reach the sampler)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from services.contracts.errors import InvalidRequestError
from services.contracts.sampling_params import SamplingParams
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from tests.model.conftest import FP32, PROMPTS

pytestmark = pytest.mark.slow

NUM_TOKENS = 12


@pytest.fixture(scope="module")
def loaded_gguf_fp32() -> LoadedModel:
    return LoadedModel.load(None, torch.float32, quantization="gguf-exact")


@pytest.fixture(scope="module", params=["eager", "fused"])
def biased_engine(
    request: pytest.FixtureRequest, loaded_fp32: LoadedModel, loaded_gguf_fp32: LoadedModel
) -> LLMEngine:
    if request.param == "eager":
        engine = LLMEngine(replace(FP32, fused_decode=False), loaded=loaded_fp32)
        assert engine.runner.fused_decode is None
    else:
        engine = LLMEngine(replace(FP32, max_num_seqs=4), loaded=loaded_gguf_fp32)
        assert engine.runner.fused_decode is not None
    return engine


def greedy(**fields: object) -> SamplingParams:
    return SamplingParams(
        temperature=0.0,
        max_new_tokens=NUM_TOKENS,
        ignore_eos=True,
        **fields,  # type: ignore[arg-type]
    )


def run(engine: LLMEngine, params: list[SamplingParams], prompts: list[int]) -> list[list[int]]:
    results = engine.generate([PROMPTS[i] for i in prompts], params)
    stats = engine.get_stats()
    assert stats.num_free_blocks == stats.num_total_blocks
    return [r.token_ids for r in results]


def test_bias_and_allow_lists_next_to_plain_requests(biased_engine: LLMEngine) -> None:
    [plain, other] = run(biased_engine, [greedy(), greedy()], [0, 3])
    banned, forced = plain[0], 42
    fused = biased_engine.runner.fused_decode
    steps_before = fused.num_steps if fused is not None else 0
    allowed = (plain[1], 13, 28)
    [unbanned, forced_ids, restricted, still_other] = run(
        biased_engine,
        [
            greedy(logit_bias={banned: -100.0}),
            SamplingParams(
                max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=1, logit_bias={forced: 100.0}
            ),  # type: ignore[arg-type]
            SamplingParams(
                max_new_tokens=NUM_TOKENS, ignore_eos=True, seed=2, allowed_token_ids=allowed
            ),
            greedy(),
        ],
        [0, 1, 2, 3],
    )
    assert banned not in unbanned and unbanned != plain
    assert forced_ids == [forced] * NUM_TOKENS  # sampled at temperature 1, yet forced
    assert set(restricted) <= set(allowed)
    assert still_other == other  # the plain request beside them is untouched
    if fused is not None:
        # Decode steps of these biased requests ran fused, and their logits were still biased.
        assert fused.num_steps > steps_before


def test_out_of_vocabulary_ids_are_refused_before_queueing(biased_engine: LLMEngine) -> None:
    vocab_size = biased_engine.architecture.vocab_size
    prompt = biased_engine.tokenizer.encode(PROMPTS[0])
    for params, field in (
        (greedy(logit_bias={vocab_size: 1.0}), f"logit_bias[{vocab_size}]"),
        (greedy(allowed_token_ids=(1, vocab_size)), "allowed_token_ids"),
    ):
        with pytest.raises(InvalidRequestError) as raised:
            biased_engine.add_request(prompt, params)
        assert raised.value.field == field
    assert not biased_engine.has_unfinished_requests()
