"""Strict decoding of public requests from hand-built wire bytes: the message when it is one,
else InvalidRequestError naming the field at fault."""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError

from protos.llmserve.v1 import text_pb2
from services.common.request_decoding import MAX_FIELDS_WALKED, WHOLE_REQUEST, decode_request
from services.contracts.errors import InvalidRequestError
from tests.wire_bytes import FIXED32, FIXED64, LEN, VARINT, len_field, tag, varint, varint_field

BAD_UTF8 = b"ok\xff"


def chat_message(role: bytes, content: bytes) -> bytes:
    return len_field(1, role) + len_field(2, content)


def refusal(message_class: type, data: bytes) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        decode_request(message_class, data)
    assert len(str(info.value)) < 200, str(info.value)
    return info.value


def test_a_valid_request_decodes_as_protobuf_does() -> None:
    request = text_pb2.GenerateRequest(
        request_id="r1",
        messages=[text_pb2.ChatMessage(role="user", content="héllo 🦊")],
        sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=5, stop=["\n"]),
        tenant_id="acme",
    )
    data = request.SerializeToString()
    assert decode_request(text_pb2.GenerateRequest, data) == request


def test_legal_non_canonical_encodings_are_accepted() -> None:
    # A default sent explicitly, a list sent unpacked, a scalar sent twice (the last wins), a
    # sub-message split in two (merged), a padded varint: all legal, all re-serialize shorter.
    data = (
        len_field(2, b"hi")
        + varint_field(6, 0)
        + varint_field(4, 1)
        + varint_field(4, 2)
        + len_field(5, varint_field(9, 3))
        + len_field(5, varint_field(13, 1))
        + varint_field(6, 10)
        + tag(6, VARINT)
        + b"\x94\x80\x00"  # 20, in three bytes
    )
    request = decode_request(text_pb2.GenerateRequest, data)
    assert request.prompt == "hi"
    assert list(request.prompt_token_ids) == [1, 2]
    assert request.sampling.max_new_tokens == 3 and request.sampling.ignore_eos
    assert request.deadline_ms == 20


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (len_field(2, BAD_UTF8), "prompt"),
        (len_field(1, b"\xc0\xaf"), "request_id"),  # an overlong encoding of "/"
        (len_field(2, b"\xed\xa0\x80"), "prompt"),  # a lone surrogate
        (len_field(7, BAD_UTF8), "model"),
        (len_field(8, BAD_UTF8), "prompt_name"),
        (len_field(9, BAD_UTF8), "tenant_id"),
        (len_field(3, chat_message(BAD_UTF8, b"x")), "messages[0].role"),
        (
            len_field(3, chat_message(b"user", b"a"))
            + len_field(3, chat_message(b"assistant", b"b"))
            + len_field(3, chat_message(b"user", BAD_UTF8)),
            "messages[2].content",
        ),
        (len_field(5, len_field(11, b"a") + len_field(11, BAD_UTF8)), "sampling.stop[1]"),
    ],
)
def test_invalid_utf8_names_the_string_field(data: bytes, field: str) -> None:
    with pytest.raises(DecodeError):
        text_pb2.GenerateRequest.FromString(data)  # what the runtime alone says
    error = refusal(text_pb2.GenerateRequest, data)
    assert error.field == field
    assert "UTF-8" in error.message


@pytest.mark.parametrize(
    ("message_class", "data", "field"),
    [
        (text_pb2.TokenizeRequest, len_field(1, BAD_UTF8), "text"),
        (text_pb2.RegisterPromptRequest, len_field(1, BAD_UTF8), "name"),
        (text_pb2.RegisterPromptRequest, len_field(2, BAD_UTF8), "system_prompt"),
        (text_pb2.RegisterPromptRequest, len_field(4, BAD_UTF8), "tenant_id"),
        (text_pb2.DeletePromptRequest, len_field(1, BAD_UTF8), "name"),
        (text_pb2.ListPromptsRequest, len_field(1, BAD_UTF8), "tenant_id"),
    ],
)
def test_every_request_type_names_its_field(message_class: type, data: bytes, field: str) -> None:
    assert refusal(message_class, data).field == field


@pytest.mark.parametrize(
    ("data", "field", "words"),
    [
        (tag(2, LEN) + varint(100) + b"short", "prompt", "declares 100 bytes, 5 remain"),
        (len_field(5, tag(9, VARINT) + b"\x80"), "sampling.max_new_tokens", "cut short"),
        (len_field(5, tag(1, FIXED32) + b"\x00\x00"), "sampling.temperature", "cut short"),
        (len_field(2, b"hi") + tag(6, 7), "deadline_ms", "wire type 7"),
        (len_field(2, b"hi") + tag(99, 6), WHOLE_REQUEST, "field number 99"),
        (len_field(5, tag(99, LEN) + varint(9)), "sampling", "field number 99"),
        (b"\x80", WHOLE_REQUEST, "cut short"),
        (b"\x00\x01", WHOLE_REQUEST, "field number 0"),
        (b"\xff" * 11, WHOLE_REQUEST, "longer than 10 bytes"),
        (len_field(4, b"\x01\x80"), "prompt_token_ids", "packed list"),
        (tag(2, 4), "prompt", "never started"),
        (tag(50, 3) + varint_field(1, 1), WHOLE_REQUEST, "never ends"),
    ],
)
def test_corrupt_wire_format_names_the_field(data: bytes, field: str, words: str) -> None:
    with pytest.raises(DecodeError):
        text_pb2.GenerateRequest.FromString(data)
    error = refusal(text_pb2.GenerateRequest, data)
    assert (error.field, words in error.message) == (field, True), error.message


def test_what_the_walk_cannot_place_is_refused_as_a_whole() -> None:
    # Groups nested deeper than the runtime's limit: nothing wrong with any one field.
    data = tag(98, 3) * 120 + tag(98, 4) * 120
    with pytest.raises(DecodeError):
        text_pb2.GenerateRequest.FromString(data)
    error = refusal(text_pb2.GenerateRequest, data)
    assert error.field == WHOLE_REQUEST
    assert "llmserve.v1.GenerateRequest" in error.message


def test_unknown_fields_and_groups_of_a_newer_client_are_skipped() -> None:
    data = (
        len_field(2, b"hi")
        + varint_field(99, 7)
        + len_field(100, BAD_UTF8)  # not a string we know: its bytes are not ours to check
        + tag(101, FIXED64)
        + b"\x00" * 8
        + tag(102, 3)
        + varint_field(1, 1)
        + tag(102, 4)
        + len_field(5, varint_field(99, 1) + varint_field(9, 4))
    )
    request = decode_request(text_pb2.GenerateRequest, data)
    assert (request.prompt, request.sampling.max_new_tokens) == ("hi", 4)


@pytest.mark.parametrize(
    ("message_class", "data", "field", "words"),
    [
        # max_new_tokens as length-delimited: protobuf would drop it and apply 256.
        (
            text_pb2.GenerateRequest,
            len_field(2, b"hi") + len_field(5, len_field(9, b"\x05")),
            "sampling.max_new_tokens",
            "has wire type length-delimited; this field's is varint",
        ),
        (text_pb2.GenerateRequest, varint_field(2, 7), "prompt", "has wire type varint"),
        (
            text_pb2.GenerateRequest,
            len_field(2, b"hi") + len_field(5, tag(1, FIXED64) + b"\x00" * 8),
            "sampling.temperature",
            "this field's is fixed32",
        ),
        (
            text_pb2.GenerateRequest,
            len_field(3, chat_message(b"user", b"a")) + len_field(3, varint_field(1, 5)),
            "messages[1].role",
            "has wire type varint",
        ),
        (
            text_pb2.GenerateRequest,
            len_field(2, b"hi") + tag(5, FIXED32) + b"\x00" * 4,
            "sampling",
            "has wire type fixed32",
        ),
        (text_pb2.DetokenizeRequest, len_field(2, b"\x01"), "skip_special_tokens", "varint"),
        (text_pb2.RegisterPromptRequest, len_field(3, b"\x01"), "ttl_s", "varint"),
    ],
)
def test_a_known_field_of_the_wrong_wire_type_is_refused(
    message_class: type, data: bytes, field: str, words: str
) -> None:
    error = refusal(message_class, data)
    assert (error.field, words in error.message) == (field, True), error.message


def test_the_runtime_sets_wrong_wire_types_aside_silently() -> None:
    # What this module is for: the runtime alone accepts the request with the default.
    data = len_field(2, b"hi") + len_field(5, len_field(9, b"\x05"))
    request = text_pb2.GenerateRequest.FromString(data)
    assert not request.sampling.HasField("max_new_tokens")


def test_a_huge_corrupt_request_is_refused_quickly() -> None:
    # A million tiny fields, then a bad one: the walk stops at its budget instead of
    # spending seconds in Python to name the field.
    data = varint_field(6, 1) * 1_000_000 + len_field(2, BAD_UTF8)
    assert MAX_FIELDS_WALKED < 1_000_000
    error = refusal(text_pb2.GenerateRequest, data)
    assert error.field == WHOLE_REQUEST
    assert "bad UTF-8" in error.message
