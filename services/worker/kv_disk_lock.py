"""One live worker per KV disk directory: the worker holds an exclusive lock on a file in it
for as long as it runs. Two workers writing and evicting the same files would each index
blocks the other deletes, so a second one is refused at start instead."""

from __future__ import annotations

import contextlib
import fcntl
import os
from pathlib import Path
from typing import IO

from services.contracts.errors import ConflictError

LOCK_NAME = ".lock"
"""Dot-named, so the tier's indexing never takes it for a block file (names are hex)."""


class KvDiskInUseError(ConflictError):
    """Another live worker holds the directory."""


class DirectoryLock:
    """flock, not a pid file: the kernel releases it when the holder dies however it dies
    (SIGKILL too), so a restart never finds a stale lock; and flock conflicts between two
    opens in one process as well (an engine opened twice)."""

    def __init__(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / LOCK_NAME
        self._file: IO[str] | None = path.open("a+")
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            self._file = None
            raise KvDiskInUseError(
                f"--kv-disk-dir {directory} is in use by another worker (pid {holder}); "
                "give each worker its own directory"
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        if self._file is not None:
            with contextlib.suppress(OSError):
                fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
