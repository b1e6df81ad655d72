"""A process's own "I serve now" file, for a launcher whose replicas share one port.

Tokenizer replicas listen on one public port (SO_REUSEPORT), so a health check sent to that
port reaches whichever replica the kernel picks: one loaded replica could answer for a
sibling still loading, and a request routed to the sibling got 503 "still loading" after the
stack said ready. The launcher names a file per replica in LLMSERVE_SERVING_MARKER; the
replica writes it when it turns SERVING, and the launcher waits for each replica's file.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV_VAR = "LLMSERVE_SERVING_MARKER"


def mark_serving() -> None:
    """Write this process's marker, if its launcher asked for one."""
    path = os.environ.get(ENV_VAR)
    if path:
        Path(path).write_text(str(os.getpid()))
