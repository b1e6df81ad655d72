"""A registered family other than the shipped Llama through the whole stack: `llmserve up
--model DIR` on a tiny random Gemma 3 directory (five windowed layers to one global, windowed
layers with their own rope, QK-norm, post-norms, GeGLU), prompts longer than its window:
greedy ids streamed over gRPC equal transformers' on the same weights."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack
from tests.model.random_hf_models import (
    VOCAB_SIZE,
    WINDOW,
    build_random_hf_model,
    load_hf_reference,
)

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_hf_model("gemma3", tmp_path_factory.mktemp("gemma3"))


@pytest.fixture(scope="module")
def gemma3_stack(gemma3_dir: Path) -> Iterator[RunningStack]:
    flags = ["--model", str(gemma3_dir), "--tokenizer-replicas", "1", "--no-redis"]
    with e2e_stack(flags) as running:
        yield running
    assert running.returncode == 0


def test_streamed_greedy_ids_equal_transformers(
    gemma3_dir: Path, gemma3_stack: RunningStack
) -> None:
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in (3 * WINDOW, 50)]
    reference = load_hf_reference(gemma3_dir)
    reference.generation_config.eos_token_id = None
    stub = gemma3_stack.text_stub()
    for ids in prompts:
        request = text_pb2.GenerateRequest(
            prompt_token_ids=ids,
            sampling=text_pb2.SamplingParams(
                max_new_tokens=NUM_NEW_TOKENS, temperature=0, ignore_eos=True
            ),
        )
        streamed = [t for reply in stub.Generate(request, timeout=300) for t in reply.token_ids]
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        assert streamed == out[0, len(ids) :].tolist()
