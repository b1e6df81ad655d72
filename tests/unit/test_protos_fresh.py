"""The checked-in generated protobuf code must match the .proto files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GENERATED = sorted((ROOT / "protos/llmserve/v1").glob("*_pb2*.py*"))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    subprocess.run(
        ["bash", str(ROOT / "scripts/gen_protos.sh"), str(tmp_path)],
        check=True,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert len(GENERATED) == 21
    for checked_in in GENERATED:
        fresh = tmp_path / checked_in.relative_to(ROOT)
        assert fresh.read_text() == checked_in.read_text(), (
            f"{checked_in.name} is stale: run scripts/gen_protos.sh"
        )


def test_public_contract_names() -> None:
    from protos.llmserve.v1 import text_pb2

    service = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"]
    assert service.full_name == "llmserve.v1.TextGeneration"
    assert {m.name for m in service.methods} >= {"Generate", "Tokenize", "Detokenize", "ListModels"}
    request_fields = set(text_pb2.GenerateRequest.DESCRIPTOR.fields_by_name)
    assert request_fields >= {
        "request_id",
        "prompt",
        "messages",
        "prompt_token_ids",
        "sampling",
        "deadline_ms",
    }
    response_fields = set(text_pb2.GenerateResponse.DESCRIPTOR.fields_by_name)
    assert response_fields >= {"text", "token_ids", "finish_reason", "usage", "timings"}


def test_one_logprob_message_on_every_hop() -> None:
    from protos.llmserve.v1 import logprobs_pb2, scheduler_pb2, text_pb2, worker_pb2

    message = logprobs_pb2.TokenLogprob.DESCRIPTOR
    # The public name and wire format of text.proto's TokenLogprob are unchanged.
    assert message.full_name == "llmserve.v1.TokenLogprob"
    assert [(f.name, f.number) for f in message.fields] == [
        ("token_id", 1),
        ("logprob", 2),
        ("top_token_ids", 3),
        ("top_logprobs", 4),
    ]
    # text.proto imports it publicly: Python clients still find text_pb2.TokenLogprob.
    assert text_pb2.TokenLogprob is logprobs_pb2.TokenLogprob
    assert text_pb2.GenerateResponse.DESCRIPTOR.fields_by_name["logprobs"].message_type is message
    assert (
        scheduler_pb2.SubmitResponse.DESCRIPTOR.fields_by_name["logprobs"].message_type is message
    )
    entry = worker_pb2.StepOutput.DESCRIPTOR.fields_by_name["logprobs"].message_type
    assert entry.fields_by_name["value"].message_type is message
