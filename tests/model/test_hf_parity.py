"""Our model, loader and tokenizer against Hugging Face transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.engine.engine import LLMEngine
from services.text.chat_template import ChatMessage
from services.worker.input_batch import InputBatch
from tests.model.conftest import PROMPTS

pytestmark = pytest.mark.slow

# fp32 on both sides; the differences are summation order only (fused q|k|v, SDPA kernels).
LOGITS_ATOL = 2e-3
NUM_NEW_TOKENS = 32


def our_last_logits(engine: LLMEngine, prompt_ids: list[int]) -> torch.Tensor:
    """Run one prefill of `prompt_ids` through our model over fresh KV blocks."""
    block_size = engine.kv_cache.spec.block_size
    num_blocks = -(-len(prompt_ids) // block_size)
    batch = InputBatch(block_size, "cpu")
    plan = BatchPlan(
        step_id=0,
        new_sequences=[
            NewSequence(
                "probe", prompt_ids, len(prompt_ids), list(range(num_blocks)), 0, SamplingParams()
            )
        ],
        num_scheduled_tokens={"probe": len(prompt_ids)},
    )
    batch.apply(plan)
    inputs = batch.prepare(plan)
    with torch.inference_mode():
        return engine.model(inputs.forward, engine.kv_cache.layers)[0]


def hf_last_logits(hf_model, prompt_ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt_ids])).logits[0, -1].float()


def test_tokenizer_matches_hf(engine: LLMEngine, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    texts = [*PROMPTS, "  leading spaces\n\n\ttabs", "1234567 + 89 = ?", "<|im_start|>user"]
    for text in texts:
        assert engine.tokenizer.encode(text) == hf_tokenizer(text).input_ids, text
        ids = engine.tokenizer.encode(text)
        assert engine.tokenizer.decode(ids) == hf_tokenizer.decode(ids, skip_special_tokens=True)


def test_chat_template_matches_hf(engine: LLMEngine, hf_tokenizer) -> None:  # type: ignore[no-untyped-def]
    conversations = [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
    ]
    for messages in conversations:
        ours = engine.tokenizer.apply_chat_template([ChatMessage(**m) for m in messages])
        text = hf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert engine.tokenizer.render_chat([ChatMessage(**m) for m in messages]) == text
        assert ours == hf_tokenizer(text, add_special_tokens=False).input_ids
    # The special tokens a template sees are the ones transformers reads from the GGUF file.
    assert engine.tokenizer.special_tokens == hf_tokenizer.special_tokens_map


def test_last_position_logits_match_hf(engine: LLMEngine, hf_model) -> None:  # type: ignore[no-untyped-def]
    for text in PROMPTS:
        ids = engine.tokenizer.encode(text)
        ours = our_last_logits(engine, ids)
        theirs = hf_last_logits(hf_model, ids)
        diff = (ours - theirs).abs().max().item()
        assert diff < LOGITS_ATOL, f"{text!r}: max abs logit diff {diff}"
        assert ours.argmax() == theirs.argmax()


def test_greedy_tokens_match_hf(engine: LLMEngine, hf_model) -> None:  # type: ignore[no-untyped-def]
    prompt_ids = [engine.tokenizer.encode(text) for text in PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    results = engine.generate(prompt_ids, greedy)  # all prompts batched together
    hf_model.generation_config.eos_token_id = None
    for ids, result in zip(prompt_ids, results, strict=True):
        with torch.inference_mode():
            out = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=NUM_NEW_TOKENS,
                do_sample=False,
                pad_token_id=0,
            )
        expected = out[0, len(ids) :].tolist()
        assert len(result.token_ids) == NUM_NEW_TOKENS
        assert result.token_ids == expected, engine.tokenizer.decode(ids)
