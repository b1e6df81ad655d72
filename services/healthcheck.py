"""`python -m services.healthcheck HOST:PORT`: exit 0 when the server reports SERVING on the
standard gRPC health service; `python -m services.healthcheck http(s)://HOST:PORT/ready`: exit
0 when that URL answers 200 (over HTTPS without checking the certificate, so the tokenizer
tier's check works with TLS on).

Container engines run this every few seconds in every container, so it costs as little as it
can: the standard library only. Importing grpc alone takes 0.15 s of CPU; with the exec, five
services checked every 15 s took a tenth of a 2-core host, in bursts that stall the decode
step's threads. So the gRPC check speaks the one call it needs itself: HTTP/2 without TLS
(prior knowledge, as a plaintext gRPC port expects), one unary `grpc.health.v1.Health/Check`
with an empty request, and the answer's `status` field read from the response message. The
launcher uses the same check, so every stack start exercises it against the real servers.
"""

from __future__ import annotations

import socket
import struct
import sys

_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_DATA, _HEADERS, _RST_STREAM, _SETTINGS, _GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x7
_END_STREAM, _ACK, _END_HEADERS = 0x1, 0x1, 0x4
_STREAM = 1
_SERVING = b"\x08\x01"  # HealthCheckResponse: field 1 (status), varint 1 (SERVING)


def _frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream)
        + payload
    )


def _literal(name_index: int, value: str) -> bytes:
    """HPACK literal without indexing, the name from the static table (index < 15)."""
    encoded = value.encode()
    return bytes((name_index, len(encoded))) + encoded


def _check_request(authority: str) -> bytes:
    headers = b"".join(
        (
            b"\x83",  # :method POST (static table 3)
            b"\x86",  # :scheme http (static table 6)
            _literal(4, "/grpc.health.v1.Health/Check"),  # :path
            _literal(1, authority),  # :authority
            b"\x0f\x10" + bytes((16,)) + b"application/grpc",  # content-type (static 31)
            b"\x00\x02te\x08trailers",  # te: trailers (a new name)
        )
    )
    message = b"\x00" + struct.pack(">I", 0)  # uncompressed, empty HealthCheckRequest
    return (
        _PREFACE
        + _frame(_SETTINGS, 0, 0)
        + _frame(_HEADERS, _END_HEADERS, _STREAM, headers)
        + _frame(_DATA, _END_STREAM, _STREAM, message)
    )


def _read_exactly(connection: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = connection.recv(size - len(data))
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
    return data


def healthy(address: str, timeout: float = 1.0) -> bool:
    """Whether the gRPC server at HOST:PORT answers SERVING for the whole server ("")."""
    host, _, port = address.rpartition(":")
    body = b""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as connection:
            connection.settimeout(timeout)
            connection.sendall(_check_request(address))
            while True:
                header = _read_exactly(connection, 9)
                length = int.from_bytes(header[:3], "big")
                kind, flags = header[3], header[4]
                stream = int.from_bytes(header[5:9], "big") & 0x7FFFFFFF
                payload = _read_exactly(connection, length)
                if kind == _SETTINGS and not flags & _ACK:
                    connection.sendall(_frame(_SETTINGS, _ACK, 0))
                elif kind in (_GOAWAY, _RST_STREAM):
                    return False
                elif stream == _STREAM and kind in (_DATA, _HEADERS):
                    if kind == _DATA:
                        body += payload
                    if flags & _END_STREAM:
                        break
    except (OSError, ValueError):
        return False
    # One length-prefixed message (flag byte, 4-byte length) holding the response.
    return len(body) >= 5 and body[0] == 0 and body[5:7] == _SERVING


def http_ready(url: str, timeout: float = 1.0) -> bool:
    """Whether GET url answers 200. Over https the certificate is not checked: this asks our
    own child on loopback whether it is up, whatever name its certificate carries."""
    # Imported here: a gRPC check does not pay for urllib and ssl (a third of its start-up).
    import ssl
    import urllib.error
    import urllib.request

    context = ssl._create_unverified_context() if url.startswith("https:") else None
    try:
        with urllib.request.urlopen(url, timeout=timeout, context=context) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def check(target: str) -> bool:
    if target.startswith(("http://", "https://")):
        return http_ready(target, timeout=2.0)
    return healthy(target, timeout=2.0)


if __name__ == "__main__":
    sys.exit(0 if len(sys.argv) == 2 and check(sys.argv[1]) else 1)
