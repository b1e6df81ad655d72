"""Offline batch inference (JSONL in, JSONL out) and loading a Hugging Face directory."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.engine.offline import run_offline
from services.worker.loaded_model import LoadedModel
from tests.model.test_hf_parity import our_last_logits

pytestmark = pytest.mark.slow


def test_offline_jsonl_in_order_with_errors(engine: LLMEngine) -> None:
    lines = [
        {
            "id": "text",
            "prompt": "The capital of France is",
            "sampling": {"temperature": 0, "max_new_tokens": 6},
        },
        {
            "id": "chat",
            "messages": [{"role": "user", "content": "Say hi"}],
            "sampling": {"temperature": 0.7, "seed": 3, "max_new_tokens": 5},
        },
        {"id": "ids", "prompt_token_ids": [504, 3458, 282], "sampling": {"max_new_tokens": 4}},
        {"id": "bad-field", "prompt": "x", "sampling": {"top_p": 2.0}},
        {"id": "unknown", "prompt": "x", "sampling": {"beam_width": 4}},
        {"id": "two-prompts", "prompt": "x", "prompt_token_ids": [1]},
    ]
    source = [json.dumps(line) for line in lines] + ["{not json"]
    sink = io.StringIO()
    failures = run_offline(engine, source, sink, show_progress=False)
    results = [json.loads(line) for line in sink.getvalue().splitlines()]
    assert [r.get("id") for r in results] == [*(line["id"] for line in lines), None]
    assert failures == 4
    text, chat, ids = results[:3]
    greedy = SamplingParams(temperature=0, max_new_tokens=6)
    expected = engine.generate(["The capital of France is"], greedy)[0]
    assert text["token_ids"] == expected.token_ids and text["text"] == expected.text
    assert text["finish_reason"] in ("stop", "length")
    assert text["usage"]["completion_tokens"] == len(text["token_ids"])
    assert chat["usage"]["prompt_tokens"] > 10  # the chat template added the system turn
    assert ids["usage"]["prompt_tokens"] == 3 and len(ids["token_ids"]) <= 4
    assert results[3]["error"]["field"] == "sampling.top_p"
    assert results[4]["error"]["field"] == "sampling.beam_width"
    assert results[5]["error"]["field"] == "prompt"
    assert results[6]["error"]["field"] == "line"
    assert engine.get_stats().num_free_blocks == engine.num_kv_blocks


def test_hugging_face_directory_loads_the_same_model(
    engine: LLMEngine,
    hf_model,
    hf_tokenizer,
    tmp_path: Path,  # type: ignore[no-untyped-def]
) -> None:
    from safetensors.torch import save_file

    # transformers refuses save_pretrained on a GGUF-loaded model, so write the directory the
    # way a Hugging Face checkpoint is laid out: config.json, safetensors, tokenizer files.
    directory = tmp_path / "smollm2-hf"
    directory.mkdir()
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    (directory / "config.json").write_text(json.dumps(config))
    state = {
        name: tensor.contiguous()
        for name, tensor in hf_model.state_dict().items()
        if not (name == "lm_head.weight" and config.get("tie_word_embeddings"))
    }
    save_file(state, str(directory / "model.safetensors"))
    hf_tokenizer.save_pretrained(directory)
    loaded = LoadedModel.load(str(directory), torch.float32)
    from_directory = LLMEngine(
        EngineConfig(dtype="float32", kv_cache_gib=64 / 1024, enforce_eager=True), loaded=loaded
    )
    prompt = "The quick brown fox"
    ids = from_directory.tokenizer.encode(prompt)
    assert ids == engine.tokenizer.encode(prompt)
    ours = our_last_logits(from_directory, ids)
    gguf = our_last_logits(engine, ids)
    assert (ours - gguf).abs().max().item() < 1e-4
    assert from_directory.tokenizer.chat_template is not None
    assert engine.tokenizer.chat_template is not None
    assert from_directory.tokenizer.chat_template.source == engine.tokenizer.chat_template.source
    assert from_directory.tokenizer.special_tokens == hf_tokenizer.special_tokens_map
