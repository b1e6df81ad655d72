"""Start `llmserve up` as a subprocess for a benchmark, wait until ready, stop it cleanly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


class LocalStack:
    def __init__(self, flags: list[str], startup_timeout_s: float = 600.0) -> None:
        self.flags = flags
        self.startup_timeout_s = startup_timeout_s
        self._dir = tempfile.TemporaryDirectory(prefix="llmserve-bench-")
        self.ready_file = Path(self._dir.name) / "ready.json"
        self.process: subprocess.Popen[bytes] | None = None
        self.info: dict[str, Any] = {}

    def __enter__(self) -> LocalStack:
        command = [sys.executable, "-m", "services.cli", "up", "--port", "0", *self.flags]
        command += ["--ready-file", str(self.ready_file)]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + self.startup_timeout_s
        while not self.ready_file.exists():
            if self.process.poll() is not None:
                raise RuntimeError(f"llmserve up {' '.join(self.flags)} exited")
            if time.monotonic() > deadline:
                raise TimeoutError("stack not ready in time")
            time.sleep(0.2)
        self.info = json.loads(self.ready_file.read_text())
        return self

    @property
    def public(self) -> str:
        return str(self.info["public"])

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self._dir.cleanup()
