"""KV transfer through shared memory, for two workers on one host (docs/disaggregation.md,
Transport): the prefill worker copies a prompt's blocks straight from its cache into a file of
the shared-memory directory (tmpfs), names it in one small gRPC message, and the decode worker
maps the file, writes the blocks into its cache and deletes it. No byte crosses a socket.

    /dev/shm/llmserve-kv-<creator pid>-<random>   [num_blocks, bytes per block] uint8
                                                    rows in KvChunk.data's layout

A file outlives neither its transfer nor its creator for long: the receiver deletes it once
read (written or refused), the sender when the push fails, and every worker sweeps, at start,
the files whose creator is gone or that are older than any transfer may take.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from pathlib import Path

import torch

from services.worker.kv_cache import PagedKVCache

PREFIX = "llmserve-kv-"
DEFAULT_DIRECTORY = "/dev/shm"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
PAGE_BYTES = 4096
STALE_AFTER_S = 600.0
"""A file this old belongs to no live transfer (a push gives up after 60 s)."""


class SharedMemoryError(Exception):
    """A shared-memory file that cannot be read as the transfer says; the message says why."""


def host_identity(directory: str) -> str:
    """Who else can open this worker's shared-memory files: the same boot of the same host
    (boot id, hostname) and the same mount of the directory (device, inode), so two containers
    that share a hostname but not /dev/shm never match. Empty when the directory is unusable."""
    if not directory:
        return ""
    try:
        stat = os.stat(directory)
        boot_id = BOOT_ID.read_text().strip() if BOOT_ID.exists() else ""
    except OSError:
        return ""
    if not os.access(directory, os.W_OK):
        return ""
    return f"{boot_id}/{socket.gethostname()}/{stat.st_dev}:{stat.st_ino}/{directory}"


def directory_of(identity: str) -> str:
    """The shared-memory directory named in a host identity."""
    return identity.split("/", 3)[3] if identity.count("/") >= 3 else ""


def create(directory: str, num_bytes: int) -> tuple[str, torch.Tensor]:
    """A new file of `num_bytes` in `directory`, mapped: its name and a uint8 view of it."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(8)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Reserve the pages now: writing a mapping of a sparse file on a full tmpfs would kill
        # the process (SIGBUS); a full directory fails here instead (ENOSPC: bytes then).
        if num_bytes:
            os.posix_fallocate(fd, 0, num_bytes)
    except OSError:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    if num_bytes == 0:
        return name, torch.empty(0, dtype=torch.uint8)
    return name, torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)


def open_mapped(directory: str, name: str, num_bytes: int) -> torch.Tensor:
    """Map a file a sender named: only a plain name of ours in `directory`, of exactly
    `num_bytes` (a size that differs means a torn or foreign file)."""
    if not name.startswith(PREFIX) or "/" in name or name in (".", ".."):
        raise SharedMemoryError(f"shm_name: {name!r} is not a KV transfer file")
    path = os.path.join(directory, name)
    try:
        size = os.stat(path).st_size
    except OSError as exc:
        raise SharedMemoryError(f"shm_name: {name!r} cannot be opened here ({exc})") from exc
    if size != num_bytes:
        raise SharedMemoryError(
            f"shm_num_bytes: the file holds {size} bytes, the transfer says {num_bytes}"
        )
    if num_bytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_file(path, shared=False, size=num_bytes, dtype=torch.uint8)


def prefault(mapped: torch.Tensor) -> None:
    """Read one byte of every page of a mapping, so the write-in on the forward thread takes
    no page faults (measured for 45 MiB: 6 ms here, the write 15 -> 10 ms)."""
    if mapped.numel():
        mapped.view(-1)[::PAGE_BYTES].sum()


def remove(directory: str, name: str) -> None:
    """Delete a transfer's file (gone already is fine: both ends may try)."""
    if name.startswith(PREFIX) and "/" not in name:
        Path(directory, name).unlink(missing_ok=True)


def sweep(directory: str, now: float | None = None) -> int:
    """Delete the transfer files whose creating process is gone or that are older than
    STALE_AFTER_S (left by a crash); the number deleted."""
    if not directory or not os.path.isdir(directory):
        return 0
    now = time.time() if now is None else now
    removed = 0
    for path in Path(directory).glob(f"{PREFIX}*"):
        try:
            pid = int(path.name.removeprefix(PREFIX).split("-", 1)[0])
            stale = not _alive(pid) or now - path.stat().st_mtime > STALE_AFTER_S
        except (ValueError, OSError):
            stale = True
        if stale:
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def copy_out(kv_cache: PagedKVCache, block_ids: list[int], out: torch.Tensor) -> None:
    """`kv_cache.read_blocks(block_ids)` written straight into `out` ([len(block_ids), bytes
    per block] uint8, e.g. a mapped file): one copy per block, no gathered intermediate.

        row i = storage[:, :, block_ids[i]] bytes | scales[:, :, block_ids[i]] bytes
    """
    num_blocks = len(block_ids)
    expected = (num_blocks, kv_cache.spec.bytes_per_block)
    if tuple(out.shape) != expected:
        raise ValueError(f"out: shape {tuple(out.shape)}, expected {expected}")
    offset = 0
    for tensor in (kv_cache.storage, kv_cache.scales):
        if tensor is None:
            continue
        block_shape = (*tensor.shape[:2], *tensor.shape[3:])
        size = tensor.element_size() * int(torch.Size(block_shape).numel())
        rows = out[:, offset : offset + size]
        for i, block in enumerate(block_ids):
            rows[i].view(tensor.dtype).view(block_shape).copy_(tensor[:, :, block])
        offset += size
