"""The tokenizer tier's GetStats poll (routing/pool.py): a scheduler that answers late keeps its
last stats for a few polls (slow, not gone), one that refuses loses them at once; against a real
gRPC server (a fake scheduler)."""

from __future__ import annotations

import grpc
import pytest

from protos.llmserve.v1 import scheduler_pb2_grpc
from services.tokenizer.routing import pool as pool_module
from services.tokenizer.routing.membership import parse_scheduler_entries
from services.tokenizer.routing.pool import MAX_SLOW_POLLS, SchedulerPool
from tests.unit.tokenizer_tier_harness import FakeEngine, run


def test_a_slow_scheduler_keeps_its_stats_for_a_few_polls_a_refusing_one_loses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "STATS_TIMEOUT_S", 0.05)

    async def scenario() -> None:
        engine = FakeEngine()
        server = grpc.aio.server()
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(engine, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        pool = SchedulerPool(parse_scheduler_entries(f"127.0.0.1:{port}"))
        pool.open()
        try:
            (client,) = pool.clients
            await pool.refresh_stats()
            assert client.stats is not None
            client.num_sent_since_poll = 3
            engine.stats_delay_s = 0.5
            for _ in range(MAX_SLOW_POLLS):
                await pool.refresh_stats()
                assert client.stats is not None and client.num_sent_since_poll == 3
            await pool.refresh_stats()  # one timeout too many: it counts as not answering
            assert client.stats is None
            engine.stats_delay_s = 0.0
            await pool.refresh_stats()
            assert client.stats is not None and client.num_slow_polls == 0
            engine.stats_available = False  # UNAVAILABLE: no grace
            await pool.refresh_stats()
            assert client.stats is None
        finally:
            await pool.close()
            await server.stop(0)

    run(scenario)
