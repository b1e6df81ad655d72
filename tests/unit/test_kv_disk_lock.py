"""One live worker per KV disk directory: a second is refused naming the flag, and the lock
goes with its holder (released, or the holder process killed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from services.worker.kv_disk_lock import LOCK_NAME, DirectoryLock, KvDiskInUseError


def test_a_second_holder_is_refused_naming_the_flag_and_the_holder(tmp_path: Path) -> None:
    first = DirectoryLock(tmp_path)
    with pytest.raises(KvDiskInUseError, match=f"--kv-disk-dir {tmp_path}.*pid {os.getpid()}"):
        DirectoryLock(tmp_path)
    first.release()
    DirectoryLock(tmp_path).release()  # free again once released


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from services.worker.kv_disk_lock import DirectoryLock; "
            f"held = DirectoryLock(Path({str(tmp_path)!r})); "
            "print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(KvDiskInUseError, match=f"pid {holder.pid}"):
            DirectoryLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    DirectoryLock(tmp_path).release()
    assert (tmp_path / LOCK_NAME).exists()
