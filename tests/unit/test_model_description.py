"""The model description the tokenizer tier builds its tokenizer from: the proto round trip,
a tokenizer rebuilt from it that matches the one read from the model file, and one model per
replica."""

from __future__ import annotations

import dataclasses

import pytest

from protos.llmserve.v1 import model_pb2
from services.common.model_description_proto import description_from_proto, description_to_proto
from services.common.model_source import embedded_model_path
from services.contracts.errors import ModelLoadError
from services.contracts.model_description import ModelDescription
from services.text.chat_template import ChatMessage
from services.text.model_tokenizer import ModelTokenizer
from services.tokenizer.served_model import ServedModel, one_model

TEXT = "Hello, world! Ünïcödé 🙂 and   spaces\n\nnew lines 12345"


@pytest.fixture(scope="module")
def file_tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


@pytest.fixture(scope="module")
def description(file_tokenizer: ModelTokenizer) -> ModelDescription:
    return file_tokenizer.describe(
        model_name="SmolLM2-135M-Instruct",
        vocab_size=file_tokenizer.vocab_size,
        max_model_len=2048,
        eos_token_ids=(0, *file_tokenizer.eos_token_ids),
    )


def test_the_proto_round_trip_keeps_every_fact(description: ModelDescription) -> None:
    message = description_to_proto(description)
    # Through bytes, as on the wire.
    wire = model_pb2.ModelDescription.FromString(message.SerializeToString())
    assert description_from_proto(wire) == description


def test_unset_optional_facts_stay_unset() -> None:
    bare = ModelDescription("m", 10, 16, "{}", None, None, (), False)
    message = description_to_proto(bare)
    assert not message.HasField("chat_template") and not message.HasField("bos_token_id")
    assert description_from_proto(message) == bare
    with_zero = dataclasses.replace(bare, chat_template="", bos_token_id=0)
    assert description_from_proto(description_to_proto(with_zero)) == with_zero


def test_the_tokenizers_eos_ids_come_first(
    file_tokenizer: ModelTokenizer, description: ModelDescription
) -> None:
    (eos,) = file_tokenizer.eos_token_ids
    assert description.eos_token_ids == (eos, 0)


def test_a_described_tokenizer_matches_the_file(
    file_tokenizer: ModelTokenizer, description: ModelDescription
) -> None:
    model = ServedModel.from_description(description)
    rebuilt = model.tokenizer
    assert (model.name, model.max_model_len, model.vocab_size) == (
        "SmolLM2-135M-Instruct",
        2048,
        file_tokenizer.vocab_size,
    )
    ids = file_tokenizer.encode(TEXT)
    assert rebuilt.encode(TEXT) == ids
    assert rebuilt.decode(ids) == file_tokenizer.decode(ids)
    messages = [ChatMessage("system", "Be brief."), ChatMessage("user", TEXT)]
    assert rebuilt.apply_chat_template(messages) == file_tokenizer.apply_chat_template(messages)
    assert rebuilt.bos_token_id == file_tokenizer.bos_token_id
    assert rebuilt.add_bos_token == file_tokenizer.add_bos_token
    assert rebuilt.chat_template is not None and file_tokenizer.chat_template is not None
    assert rebuilt.chat_template.source == file_tokenizer.chat_template.source
    assert rebuilt.special_tokens == file_tokenizer.special_tokens


def test_a_replica_serves_one_model(description: ModelDescription) -> None:
    shorter = dataclasses.replace(description, max_model_len=512)
    assert one_model({"a:1": description, "b:2": shorter}).max_model_len == 512
    other = dataclasses.replace(description, model_name="Other-1B")
    with pytest.raises(ModelLoadError, match="different models"):
        one_model({"a:1": description, "b:2": other})
    retokenized = dataclasses.replace(description, tokenizer_json="{}")
    with pytest.raises(ModelLoadError, match="b:2 differs"):
        one_model({"a:1": description, "b:2": retokenized})
