"""The container health check's own gRPC health call (services/healthcheck.py speaks HTTP/2
itself, standard library only) against a real grpc server's standard health service."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from services.healthcheck import healthy

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def server() -> Iterator[tuple[str, health.HealthServicer]]:
    servicer = health.HealthServicer()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    yield f"127.0.0.1:{port}", servicer
    grpc_server.stop(grace=None)


def test_serving_then_not_serving(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("", SERVING)
    assert healthy(address)
    servicer.set("", NOT_SERVING)
    assert not healthy(address)
    servicer.set("", SERVING)
    assert healthy(address)


def test_unknown_status_is_not_healthy(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("", health_pb2.HealthCheckResponse.UNKNOWN)
    assert not healthy(address)


def test_many_checks_in_a_row(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    servicer.set("", SERVING)
    assert all(healthy(address) for _ in range(20))


def test_closed_port_is_not_healthy() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    assert not healthy(f"127.0.0.1:{port}", timeout=0.5)


@pytest.mark.parametrize("reply", [b"", b"HTTP/1.1 400 Bad Request\r\n\r\n", b"\x00" * 64])
def test_a_server_that_is_not_grpc_is_not_healthy(reply: bytes) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def answer() -> None:
        connection, _ = listener.accept()
        with connection:
            connection.recv(4096)
            connection.sendall(reply)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        assert not healthy(f"127.0.0.1:{port}", timeout=0.5)
    finally:
        thread.join(timeout=2)
        listener.close()


def test_a_silent_server_times_out_as_not_healthy() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert not healthy(f"127.0.0.1:{port}", timeout=0.3)


def test_command_exit_status(server: tuple[str, health.HealthServicer]) -> None:
    address, servicer = server
    command = [sys.executable, "-m", "services.healthcheck", address]
    servicer.set("", SERVING)
    assert subprocess.run(command, check=False, timeout=30).returncode == 0
    servicer.set("", NOT_SERVING)
    assert subprocess.run(command, check=False, timeout=30).returncode == 1


def test_the_check_imports_no_grpc() -> None:
    """Its cost in a container is the point: grpc's import alone would triple it."""
    code = "import sys, services.healthcheck; print('grpc' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"
