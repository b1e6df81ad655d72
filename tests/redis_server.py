"""A real redis-server for tests: started on a free loopback port, stopped, restarted."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from services.launcher import free_port


class RedisServer:
    def __init__(self, *extra_args: str, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError(
                "redis-server is not installed (scripts/setup.sh installs it from Debian)"
            )
        self.binary = binary
        self.port = port or free_port("127.0.0.1")
        self.extra_args = list(extra_args)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> RedisServer:
        command = [self.binary, "--bind", "127.0.0.1", "--port", str(self.port)]
        command += ["--save", "", "--appendonly", "no", *self.extra_args]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=Path("/tmp")
        )
        deadline = time.monotonic() + 10
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)
        self.process = None

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                reply = sock.recv(64)
                return reply.startswith((b"+PONG", b"-NOAUTH"))
        except OSError:
            return False

    def command(self, *args: str) -> bytes:
        """One command over a raw socket (no client library between the test and Redis)."""
        parts = [f"*{len(args)}\r\n".encode()]
        for arg in args:
            data = arg.encode()
            parts.append(b"$%d\r\n%s\r\n" % (len(data), data))
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(b"".join(parts))
            return sock.recv(1 << 16)


@contextmanager
def redis_recipe(
    script: str, env: Mapping[str, str]
) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A container's `sh -c` script that starts `redis-server -` (its configuration, the
    password, on stdin), run here on loopback and a free port instead of the container's
    6379: (the shell's process, which exec makes redis-server, and its port) once Redis
    answers, refusing a client without the password."""
    port = free_port("127.0.0.1")
    script = script.replace("redis-server -", f"redis-server - --bind 127.0.0.1 --port {port}")
    process = subprocess.Popen(
        ["sh", "-c", script], env=dict(env), stdout=subprocess.DEVNULL, cwd="/tmp"
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2) as connection:
                    connection.sendall(b"PING\r\n")
                    assert connection.recv(64).startswith(b"-NOAUTH")
                break
            except OSError:
                assert time.monotonic() < deadline and process.poll() is None
                time.sleep(0.05)
        yield process, port
    finally:
        process.terminate()
        process.wait(timeout=10)
