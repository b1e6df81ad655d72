"""The KV disk tier: full cached blocks kept as files below the worker's pool, so a prefix
outlives eviction and restarts (docs/prefix-cache.md, Disk tier). Writes are write-behind on a
thread of their own; any disk failure turns the tier off (logged once, counted) and serving
goes on without it.

One file per block, named by its chain hash (hex), written to a temporary name then renamed:

    offset 0      8 bytes   magic b"LLMKVD01"
           8      4 bytes   header length H, little-endian
          12      H bytes   header, UTF-8 JSON: block hash, model fingerprint, cache identity
                            (KV dtype, block size, layers, KV heads, head dim), adapter, cache
                            salt, payload length and blake2b-256 of the payload
          12 + H            payload: the block's row of `PagedKVCache.read_blocks`
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import queue
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.worker import metrics
from services.worker.kv_transfer import CacheIdentity

log = logging.getLogger(__name__)

# The step path hands the writer the block's row as a buffer (a view of the one copy out of
# the cache): turning it into bytes, hashing and writing it all happen on the writer thread.
Payload = bytes | memoryview

MAGIC = b"LLMKVD01"
_LENGTH = struct.Struct("<I")
_TMP_SUFFIX = ".tmp"
_FINGERPRINT_BYTES = 1 << 20
"""A model file's fingerprint hashes its first MiB (the GGUF header and tensor table) and its
size: cheap at start, and any other file or quantization differs there."""


def model_fingerprint(path: Path) -> str:
    """Identity of the model's weights: size and a hash of the first MiB of each file (one GGUF
    file, or the files of a model directory in name order)."""
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    digest = hashlib.blake2b(digest_size=16)
    for file in files:
        digest.update(f"{file.name}:{file.stat().st_size};".encode())
        with file.open("rb") as f:
            digest.update(f.read(_FINGERPRINT_BYTES))
    return digest.hexdigest()


@dataclass(frozen=True, slots=True)
class DiskIdentity:
    """What a block file must have been written under to be used here."""

    model_fingerprint: str
    cache: CacheIdentity

    def as_header(self) -> dict[str, Any]:
        return {"model_fingerprint": self.model_fingerprint, **asdict(self.cache)}


@dataclass(frozen=True, slots=True)
class BlockScope:
    """The adapter and cache salt a block was computed under (also folded into its hash)."""

    lora_name: str = ""
    cache_salt: bytes = b""


class KvDiskTier:
    """The directory's index (LRU by bytes) and the file reads and writes. `put` runs on the
    writer thread and `get` on the forward thread, so the index is guarded by a lock."""

    def __init__(self, directory: Path, capacity_bytes: int, identity: DiskIdentity) -> None:
        self.directory = directory
        self.capacity_bytes = capacity_bytes
        self.identity = identity
        self.enabled = True
        self._expected = identity.as_header()
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        """block hash hex → file bytes, least recently used first."""
        self._changed: dict[str, None] = {}
        """Hashes added or removed since the last `take_changes` (insertion-ordered)."""
        self.num_bytes = 0

    # --- start -----------------------------------------------------------------------------

    def open(self) -> list[str]:
        """Index the directory: keep every file whose header matches this worker and whose
        payload checks, delete the rest (and leftovers of interrupted writes). Returns the
        hashes kept, oldest first."""
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            entries = sorted(self.directory.iterdir(), key=_mtime)
        except OSError as exc:
            self.disable("open", exc)
            return []
        for path in entries:
            if path.name.startswith("."):  # the directory's lock (kv_disk_lock.py)
                continue
            if path.name.endswith(_TMP_SUFFIX):
                _unlink(path)
                continue
            if self._read_checked(path.name, None) is None:
                continue
            self._sizes[path.name] = path.stat().st_size
            self.num_bytes += self._sizes[path.name]
        with self._lock:
            self._evict_to(0)
        return list(self._sizes)

    # --- writes (writer thread) ------------------------------------------------------------

    def put(self, block_hash: bytes, scope: BlockScope, payload: Payload) -> bool:
        """Write one block; False when it is already there or the tier is off."""
        name = block_hash.hex()
        if not self.enabled or name in self._sizes:
            return False
        header = json.dumps(
            {
                "block_hash": name,
                **self._expected,
                "lora_name": scope.lora_name,
                "cache_salt": scope.cache_salt.hex(),
                "payload_bytes": _nbytes(payload),
                "payload_blake2b": hashlib.blake2b(payload, digest_size=32).hexdigest(),
            },
            sort_keys=True,
        ).encode()
        size = len(MAGIC) + _LENGTH.size + len(header) + _nbytes(payload)
        if size > self.capacity_bytes:
            return False
        tmp = self.directory / f"{name}.{os.getpid()}{_TMP_SUFFIX}"
        try:
            with tmp.open("wb") as f:
                f.write(MAGIC + _LENGTH.pack(len(header)) + header)
                f.write(payload)
            # the rename makes the whole file appear at once: a reader never sees half of it
            os.replace(tmp, self.directory / name)
        except OSError as exc:
            _unlink(tmp)
            self.disable("write", exc)
            return False
        with self._lock:
            self._evict_to(size)
            self._sizes[name] = size
            self.num_bytes += size
            self._changed[name] = None
        metrics.KV_DISK_BLOCKS.labels("written").inc()
        metrics.KV_DISK_BYTES.labels("written").inc(_nbytes(payload))
        return True

    def _evict_to(self, incoming: int) -> None:
        """Drop least recently used files until `incoming` more bytes fit (lock held)."""
        while self._sizes and self.num_bytes + incoming > self.capacity_bytes:
            name, size = self._sizes.popitem(last=False)
            self.num_bytes -= size
            self._changed[name] = None
            _unlink(self.directory / name)
            metrics.KV_DISK_BLOCKS.labels("evicted").inc()

    # --- reads (forward thread) ------------------------------------------------------------

    def contains(self, block_hash: bytes) -> bool:
        return self.enabled and block_hash.hex() in self._sizes

    def get(self, block_hash: bytes, scope: BlockScope) -> bytes | None:
        """The block's payload, or None: not on disk, tier off, or refused (then deleted)."""
        name = block_hash.hex()
        if not self.contains(block_hash):
            return None
        started = time.perf_counter()
        payload = self._read_checked(name, scope)
        if payload is None:
            return None
        with self._lock:
            if name in self._sizes:
                self._sizes.move_to_end(name)
        metrics.KV_DISK_LOAD_DURATION.observe(time.perf_counter() - started)
        metrics.KV_DISK_BLOCKS.labels("read").inc()
        metrics.KV_DISK_BYTES.labels("read").inc(len(payload))
        return payload

    def payload(self, block_hash: bytes, lora_name: str, cache_salt: bytes) -> bytes | None:
        """`get` for a KV export to another pair (kv_transfer.DiskBlocks)."""
        return self.get(block_hash, BlockScope(lora_name, cache_salt))

    def _read_checked(self, name: str, scope: BlockScope | None) -> bytes | None:
        """Read a block file and check it against this worker (and `scope` when given); a
        file that does not check is deleted and forgotten, never used."""
        path = self.directory / name
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            self._forget(name)
            return None
        except OSError as exc:
            self.disable("read", exc)
            return None
        problem, payload = self._check(name, data, scope)
        if problem is None:
            return payload
        log.warning("kv disk block refused", extra={"block": name, "reason": problem})
        metrics.KV_DISK_BLOCKS.labels("refused").inc()
        _unlink(path)
        self._forget(name)
        return None

    def _check(self, name: str, data: bytes, scope: BlockScope | None) -> tuple[str | None, bytes]:
        start = len(MAGIC) + _LENGTH.size
        if len(data) < start or not data.startswith(MAGIC):
            return "not a KV block file", b""
        (header_len,) = _LENGTH.unpack_from(data, len(MAGIC))
        try:
            header = json.loads(data[start : start + header_len])
        except ValueError:
            return "unreadable header", b""
        if not isinstance(header, dict):
            return "unreadable header", b""
        if header.get("block_hash") != name:
            return "file name is not the header's block hash", b""
        for field, expected in self._expected.items():
            if header.get(field) != expected:
                return f"{field} is {header.get(field)!r}, this worker's {expected!r}", b""
        if scope is not None and (header.get("lora_name"), header.get("cache_salt")) != (
            scope.lora_name,
            scope.cache_salt.hex(),
        ):
            return "written for another adapter or cache salt", b""
        payload = data[start + header_len :]
        if len(payload) != header.get("payload_bytes"):
            return "payload length differs from the header's", b""
        if hashlib.blake2b(payload, digest_size=32).hexdigest() != header.get("payload_blake2b"):
            return "payload checksum mismatch", b""
        return None, payload

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._sizes.pop(name, None)
            if size is not None:
                self.num_bytes -= size
                self._changed[name] = None

    # --- reporting -------------------------------------------------------------------------

    def hashes(self) -> list[bytes]:
        with self._lock:
            return [bytes.fromhex(name) for name in self._sizes]

    def take_changes(self) -> tuple[list[bytes], list[bytes]]:
        """Blocks on disk now and gone now, of those changed since the last call: the net
        state, so a block written, evicted and written again reads as there."""
        with self._lock:
            changed, self._changed = self._changed, {}
            added = [bytes.fromhex(n) for n in changed if n in self._sizes]
            evicted = [bytes.fromhex(n) for n in changed if n not in self._sizes]
        return added, evicted

    def disable(self, op: str, exc: OSError) -> None:
        """Degrade, never fail: one warning, one metric, then serve without the tier."""
        metrics.KV_DISK_ERRORS.labels(op).inc()
        if not self.enabled:
            return
        self.enabled = False
        log.warning(
            "kv disk tier off: serving without it",
            extra={"op": op, "directory": str(self.directory), "error": str(exc)},
        )
        with self._lock:
            self._changed.update(dict.fromkeys(self._sizes))
            self._sizes.clear()
            self.num_bytes = 0


class DiskWriter:
    """Write-behind: blocks to write wait in a bounded queue that one thread drains, so the
    step path only enqueues. `close` writes what is pending (a graceful stop); a killed
    worker loses only the blocks still queued."""

    MAX_PENDING = 4096

    def __init__(self, tier: KvDiskTier) -> None:
        self.tier = tier
        self._queue: queue.Queue[tuple[bytes, BlockScope, Payload] | None] = queue.Queue(
            self.MAX_PENDING
        )
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, block_hash: bytes, scope: BlockScope, payload: Payload) -> None:
        if not self.tier.enabled:
            return
        try:
            self._queue.put_nowait((block_hash, scope, payload))
        except queue.Full:
            # a disk slower than the cache fills: drop rather than stall a step
            metrics.KV_DISK_BLOCKS.labels("dropped").inc()

    def flush(self) -> None:
        """Wait until every block submitted so far is written."""
        self._queue.join()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self.tier.put(*item)
            except Exception:  # the writer must outlive any one block
                log.exception("kv disk write failed")
            finally:
                self._queue.task_done()


def _nbytes(payload: Payload) -> int:
    return payload.nbytes if isinstance(payload, memoryview) else len(payload)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _unlink(path: Path) -> None:
    with contextlib.suppress(OSError):  # a file that cannot be deleted is not indexed either way
        path.unlink(missing_ok=True)
