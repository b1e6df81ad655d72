"""Protobuf wire bytes built by hand, for tests of requests no protobuf library would write:
invalid UTF-8 in a string field, a length running past the end, a field of the wrong wire
type."""

from __future__ import annotations

VARINT = 0
FIXED64 = 1
LEN = 2
FIXED32 = 5


def varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int32/int64 travel as 10-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def tag(number: int, wire_type: int) -> bytes:
    return varint(number << 3 | wire_type)


def varint_field(number: int, value: int) -> bytes:
    return tag(number, VARINT) + varint(value)


def len_field(number: int, payload: bytes) -> bytes:
    """A length-delimited field: a string, bytes, a sub-message or a packed list."""
    return tag(number, LEN) + varint(len(payload)) + payload
