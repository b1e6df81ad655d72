"""The Redis side against a real redis-server: the store's failure handling, the prefix index
(publisher → locator), named-prompt records, ACL users."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import time
from collections.abc import Iterator

import pytest

from services.common.cache_keys import CacheKeys
from services.common.named_prompt import NamedPrompt
from services.common.prefix_hash import prefix_block_hashes
from services.common.prompt_store import PromptStore
from services.common.redis_store import RedisStore, redact_url
from services.scheduler.prefix_index import PrefixIndexPublisher
from services.tokenizer.routing.prefix_locator import PrefixLocator
from tests.redis_server import RedisServer

KEYS = CacheKeys("test-model")
HASHES = prefix_block_hashes(list(range(64)), 16)  # four chained blocks


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    server = RedisServer().start()
    yield server
    server.stop()


def run(coroutine):  # type: ignore[no-untyped-def]
    return asyncio.run(coroutine)


def test_index_round_trip_epochs_and_evictions(redis: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis.url)
        publisher = PrefixIndexPublisher(store, "sched-a")
        locator = PrefixLocator(store, KEYS)
        cached = list(HASHES[:3])
        publisher.attach("epoch-1", KEYS, lambda: list(cached))
        await publisher.flush()  # the attach resync writes the snapshot
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-1")]) == [3]
        # Another epoch (the worker restarted): the same entries are stale.
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-2")]) == [0]
        assert await locator.cached_blocks(HASHES, [("sched-b", "epoch-1")]) == [0]
        # Evicting the middle block cuts the prefix there; a later block alone does not count.
        publisher.block_evicted(HASHES[1])
        publisher.block_cached(HASHES[3])
        await publisher.flush()
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-1")]) == [1]
        ttl_ms = int(redis.command("PTTL", KEYS.block("sched-a", HASHES[0])).split(b":")[1])
        assert 0 < ttl_ms <= publisher.ttl_s * 1000
        await store.close()

    run(scenario())


def test_disk_tier_blocks_stay_indexed_after_the_pool_evicts_them(redis: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis.url)
        publisher = PrefixIndexPublisher(store, "sched-a")
        locator = PrefixLocator(store, KEYS)
        on_disk = [HASHES[0], HASHES[1]]  # a restarted worker's disk: its pool is empty
        publisher.attach("epoch-2", KEYS, lambda: [], lambda: list(on_disk))
        await publisher.flush()
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-2")]) == [2]
        entry = KEYS.block("sched-a", HASHES[0])
        assert redis.command("GET", entry).split(b"\r\n")[1] == b"epoch-2:disk"
        # Loaded back into the pool, then written down: the pool's tier is what the entry says.
        publisher.block_cached(HASHES[0])
        publisher.block_cached(HASHES[2])
        publisher.disk_added(HASHES[2])
        await publisher.flush()
        assert redis.command("GET", entry).split(b"\r\n")[1] == b"epoch-2"
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-2")]) == [3]
        # The pool evicts block 0, the disk still has it: still indexed, as a disk block.
        publisher.block_evicted(HASHES[0])
        await publisher.flush()
        assert redis.command("GET", entry).split(b"\r\n")[1] == b"epoch-2:disk"
        # The disk evicts block 1 too, which the pool never held: its entry goes, and the
        # prefix is cut there.
        publisher.disk_evicted(HASHES[1])
        await publisher.flush()
        assert redis.command("EXISTS", KEYS.block("sched-a", HASHES[1])) == b":0\r\n"
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-2")]) == [1]
        # Another epoch's disk entries are stale like any other.
        assert await locator.cached_blocks(HASHES, [("sched-a", "epoch-3")]) == [0]
        await store.close()

    run(scenario())


def test_flushed_redis_is_repaired_by_the_periodic_refresh(redis: RedisServer) -> None:
    async def scenario() -> None:
        now = [0.0]
        store = RedisStore(redis.url)
        publisher = PrefixIndexPublisher(store, "s", refresh_s=10, clock=lambda: now[0])
        locator = PrefixLocator(store, KEYS)
        publisher.attach("e", KEYS, lambda: list(HASHES))
        await publisher.flush()
        redis.command("FLUSHALL")
        assert await locator.cached_blocks(HASHES, [("s", "e")]) == [0]  # a miss, no error
        now[0] = 11.0
        await publisher.flush()
        assert await locator.cached_blocks(HASHES, [("s", "e")]) == [4]
        await store.close()

    run(scenario())


def test_redis_down_is_a_fast_miss_and_recovery_needs_no_restart(redis: RedisServer) -> None:
    async def scenario() -> None:
        store = RedisStore(redis.url, op_timeout_s=0.2, retry_after_s=0.3)
        publisher = PrefixIndexPublisher(store, "s")
        locator = PrefixLocator(store, KEYS)
        publisher.attach("e", KEYS, lambda: list(HASHES))
        await publisher.flush()
        redis.stop()
        started = time.monotonic()
        assert await locator.cached_blocks(HASHES, [("s", "e")]) == [0]
        assert not store.available and store.num_errors == 1
        # While "down", calls answer at once without touching the network.
        assert await locator.cached_blocks(HASHES, [("s", "e")]) == [0]
        assert store.num_errors == 1 and time.monotonic() - started < 2.0
        publisher.block_evicted(HASHES[0])
        await asyncio.sleep(0.35)
        await publisher.flush()  # fails: the diff is dropped, a resync is owed
        redis.start()  # same port, empty
        await asyncio.sleep(0.35)
        publisher.block_cached(HASHES[0])
        await publisher.flush()  # Redis answers again: full resync from the snapshot
        assert store.available and store.num_recoveries == 1
        await publisher.flush()
        assert await locator.cached_blocks(HASHES, [("s", "e")]) == [4]
        await store.close()

    run(scenario())


def test_named_prompt_records_are_per_tenant(redis: RedisServer) -> None:
    async def scenario() -> None:
        prompts = PromptStore(RedisStore(redis.url), KEYS)
        expires = time.time() + 60
        shared = NamedPrompt("kind", "", "be kind", (1, 2, 3), expires, 60)
        acme = NamedPrompt("kind", "acme", "be kind to acme", (4, 5), expires, 60)
        assert await prompts.save(shared) and await prompts.save(acme)
        assert await prompts.get("", "kind") == (True, shared)
        assert await prompts.get("acme", "kind") == (True, acme)
        assert await prompts.get("other", "kind") == (True, None)
        assert [p.tenant_id for p in await prompts.list(None) or []] == ["", "acme"]
        assert await prompts.list("acme") == [acme]
        assert await prompts.delete("acme", "kind") is True
        assert await prompts.delete("acme", "kind") is False
        ttl_ms = int(redis.command("PTTL", KEYS.prompt("", "kind")).split(b":")[1])
        assert 0 < ttl_ms <= 60_000
        redis.stop()
        assert await prompts.get("", "kind") == (False, None)  # not answered ≠ not found
        assert await prompts.list(None) is None

    run(scenario())


def test_acl_user_and_password_in_the_url() -> None:
    server = RedisServer(
        "--user", "default", "off", "--user", "llm", "on", ">s3cret", "~*", "&*", "+@all"
    ).start()
    try:

        async def scenario() -> None:
            good = RedisStore(f"redis://llm:s3cret@127.0.0.1:{server.port}")
            assert await good.call("ping", lambda c: c.ping()) is True
            bad = RedisStore(f"redis://llm:wrong@127.0.0.1:{server.port}")
            assert await bad.call("ping", lambda c: c.ping()) is None
            assert bad.num_errors == 1
            await good.close()
            await bad.close()

        run(scenario())
    finally:
        server.stop()
    assert redact_url("redis://llm:s3cret@h:1/0") == "redis://llm:***@h:1/0"


def test_tls_with_a_ca_certificate(tmp_path) -> None:  # type: ignore[no-untyped-def]
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    openssl = ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    openssl += ["-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"]
    subprocess.run(
        [*openssl, "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True
    )
    tls_port = RedisServer().port  # a free port; plain TCP is off, so only TLS answers there
    tls = ["--tls-port", str(tls_port), "--tls-cert-file", str(cert), "--tls-key-file", str(key)]
    tls += ["--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no"]
    binary = shutil.which("redis-server")
    assert binary is not None
    process = subprocess.Popen(
        [binary, "--port", "0", "--save", "", *tls],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    async def scenario() -> None:
        url = f"rediss://127.0.0.1:{tls_port}?ssl_cert_reqs=required&ssl_ca_certs={cert}"
        for _ in range(50):  # until the server listens
            store = RedisStore(url, retry_after_s=0.0)
            if await store.call("ping", lambda c: c.ping()) is True:
                break
            await store.close()
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("no TLS connection")
        plain = RedisStore(f"redis://127.0.0.1:{tls_port}")
        assert await plain.call("ping", lambda c: c.ping()) is None  # a miss, not a crash
        await store.close()
        await plain.close()

    try:
        run(scenario())
    finally:
        process.terminate()
        process.wait(timeout=10)
