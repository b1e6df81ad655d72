"""A model whose every layer has a sliding window (a tiny random Mistral, window 32) run
through the in-process engine: the worker reports its window, the scheduler gives back the
blocks a request's window has passed, and greedy decoding is still transformers' token for
token, in a KV pool smaller than the sequence (so released blocks are reused while it runs)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from protos.llmserve.v1 import worker_pb2
from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.config import WorkerConfig
from services.worker.loaded_model import LoadedModel
from services.worker.server import WorkerServicer
from tests.model.random_hf_models import (
    VOCAB_SIZE,
    WINDOW,
    build_random_hf_model,
    load_hf_reference,
)

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
PROMPT_LEN = 100
NUM_NEW_TOKENS = 64
NUM_BLOCKS = 8  # 128 tokens of KV for a sequence of 164


@pytest.fixture(scope="module")
def mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_hf_model("mistral", tmp_path_factory.mktemp("mistral"))


def hf_greedy(directory: Path, ids: list[int]) -> list[int]:
    hf_model = load_hf_reference(directory)
    hf_model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(ids) :].tolist())


def make_engine(directory: Path) -> LLMEngine:
    loaded = LoadedModel.load(str(directory), torch.float32)
    arch = loaded.model.architecture
    bytes_per_block = arch.num_layers * 2 * BLOCK_SIZE * arch.num_kv_heads * arch.head_dim * 4
    config = EngineConfig(
        dtype="float32",
        kv_cache_gib=NUM_BLOCKS * bytes_per_block / 2**30,
        seed=0,
        enforce_eager=True,
        max_num_batched_tokens=40,  # the prompt in chunks: later chunks start past the window
        block_size=BLOCK_SIZE,
        debug_checks=True,
        # One token per decode step, so the blocks held are counted step by step (drafts
        # under a window: tests/unit/test_scheduler_sliding_window.py).
        speculation=False,
    )
    return LLMEngine(config, loaded=loaded)


def test_blocks_before_the_window_are_freed_and_greedy_matches_transformers(
    mistral_dir: Path,
) -> None:
    engine = make_engine(mistral_dir)
    assert engine.num_kv_blocks == NUM_BLOCKS
    assert engine.scheduler.kv.sliding_window == WINDOW

    ids = torch.randint(3, VOCAB_SIZE, (PROMPT_LEN,), generator=torch.Generator().manual_seed(2))
    prompt = ids.tolist()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    request_id = engine.add_request(prompt, greedy)
    tokens: list[int] = []
    held_while_decoding: list[int] = []
    while engine.has_unfinished_requests():
        for event in engine.step():
            assert event.request_id == request_id
            tokens.extend(event.new_token_ids)
        stats = engine.get_stats()
        if tokens and stats.num_running:
            held_while_decoding.append(stats.num_total_blocks - stats.num_free_blocks)

    assert tokens == hf_greedy(mistral_dir, prompt)
    # Without the window the sequence needs 11 blocks and would end at 128 tokens.
    assert len(held_while_decoding) == NUM_NEW_TOKENS - 1
    assert max(held_while_decoding) <= -(-WINDOW // BLOCK_SIZE) + 2
    assert engine.get_stats().num_free_blocks == NUM_BLOCKS


def test_the_worker_describes_its_window(mistral_dir: Path) -> None:
    engine = make_engine(mistral_dir)
    servicer = WorkerServicer(WorkerConfig())
    servicer.attach(engine.loaded, engine.runner)
    description = asyncio.run(
        servicer.Describe(worker_pb2.DescribeRequest(), None)  # type: ignore[arg-type]
    )
    assert description.sliding_window == WINDOW
    assert description.num_kv_blocks == NUM_BLOCKS
