"""The schedulers behind this tokenizer replica: channels, their load, and routing.

At start-up the schedulers pass on the model their workers describe (tokenizer, chat template,
limits: `wait_until_warm`). A background task polls every scheduler's GetStats (`poll_s`): load
for routing, and the block size and worker epoch the prefix index needs. `pick` asks the prefix
index (Redis) how much of the prompt each scheduler holds, then applies the routing policy
(routing.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from protos.llmserve.v1 import engine_pb2, engine_pb2_grpc, model_pb2
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel
from services.common.model_description import ModelDescription
from services.common.model_description_proto import description_from_proto
from services.common.prefix_hash import BlockHash, prefix_block_hashes
from services.tokenizer import metrics
from services.tokenizer.prefix_locator import MAX_LOOKUP_BLOCKS, PrefixLocator
from services.tokenizer.routing import (
    Candidate,
    RecentRoutes,
    RoutingPolicy,
    SchedulerLoad,
    choose_scheduler,
)
from services.tokenizer.served_model import one_model

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SchedulerClient:
    address: str
    channel: grpc.aio.Channel
    stub: engine_pb2_grpc.EngineStub
    stats: engine_pb2.EngineStats | None = None
    """The last GetStats answer; None while it does not answer."""
    num_sent_since_poll: int = 0

    def load(self) -> SchedulerLoad | None:
        if self.stats is None:
            return None
        return SchedulerLoad(
            self.stats.num_running, self.stats.num_waiting, self.num_sent_since_poll
        )


class SchedulerPool:
    def __init__(
        self,
        addresses: Sequence[str],
        *,
        policy: RoutingPolicy = "cache_aware",
        locator: PrefixLocator | None = None,
        overload_queued: int = 8,
        poll_s: float = 0.1,
        internal_secret: str | None = None,
    ) -> None:
        self.addresses = tuple(addresses)
        self.internal_secret = internal_secret
        self.policy = policy
        self.locator = locator
        self.overload_queued = overload_queued
        self.poll_s = poll_s
        self.clients: list[SchedulerClient] = []
        self._turn = itertools.count()
        self._recent = RecentRoutes()

    def open(self) -> None:
        """Creates the channels; must run on the event loop that will use them. Every call on
        them carries the stack's internal secret, whichever module makes it."""
        for address in self.addresses:
            channel = internal_channel(address, self.internal_secret, CHANNEL_OPTIONS)
            self.clients.append(
                SchedulerClient(address, channel, engine_pb2_grpc.EngineStub(channel))
            )

    async def pick(self, prompt_token_ids: Sequence[int], cache_salt: bytes) -> SchedulerClient:
        turn = next(self._turn)
        if len(self.clients) == 1:
            metrics.ROUTED.labels(self.policy, "only").inc()
            return self.clients[0]
        cached = [0] * len(self.clients)
        hashes: list[BlockHash] = []
        if self.policy == "cache_aware":
            hashes = self._block_hashes(prompt_token_ids, cache_salt)
            cached = self._recent.leading_blocks(hashes, len(self.clients))
            if self.locator is not None and hashes:
                indexed = await self._indexed_blocks(hashes)
                cached = [max(a, b) for a, b in zip(cached, indexed, strict=True)]
        candidates = [
            Candidate(count, client.load())
            for count, client in zip(cached, self.clients, strict=True)
        ]
        index = choose_scheduler(
            candidates, self.policy, turn=turn, overload_queued=self.overload_queued
        )
        self._recent.remember(hashes, index)
        client = self.clients[index]
        client.num_sent_since_poll += 1
        metrics.ROUTED.labels(self.policy, _reason(self.policy, candidates, index)).inc()
        return client

    def _block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: bytes) -> list[BlockHash]:
        """The prompt's full-block hashes at the schedulers' block size (all serve one model
        with one block size; a scheduler reporting another size never matches)."""
        block_size = next((c.stats.block_size for c in self.clients if c.stats), 0)
        if not block_size:
            return []
        return prefix_block_hashes(
            prompt_token_ids, block_size, cache_salt, max_blocks=MAX_LOOKUP_BLOCKS
        )

    async def _indexed_blocks(self, hashes: Sequence[BlockHash]) -> list[int]:
        """Per scheduler: leading blocks the Redis index says it holds (current epoch only)."""
        assert self.locator is not None
        known = [(i, c.stats) for i, c in enumerate(self.clients) if c.stats is not None]
        found = await self.locator.cached_blocks(
            hashes, [(stats.scheduler_id, stats.worker_epoch) for _, stats in known]
        )
        counts = [0] * len(self.clients)
        for (i, _), count in zip(known, found, strict=True):
            counts[i] = count
        return counts

    async def poll_forever(self) -> None:
        """Keep every scheduler's stats fresh (routing reads them; never awaited per request)."""
        while True:
            await asyncio.gather(*(self._poll(client) for client in self.clients))
            await asyncio.sleep(self.poll_s)

    async def _poll(self, client: SchedulerClient) -> None:
        try:
            stats = await client.stub.GetStats(engine_pb2.GetStatsRequest(), timeout=1.0)
        except grpc.aio.AioRpcError:
            stats = None
        client.stats = stats
        client.num_sent_since_poll = 0

    async def wait_until_warm(self, poll_s: float) -> ModelDescription:
        """Waits until a scheduler answers with its worker connected and returns the model
        that worker describes; every scheduler answering by then must serve the same model
        (ModelLoadError otherwise). Retries every poll_s."""
        while True:
            await self._first_answering(poll_s)
            answers = await asyncio.gather(*(self._describe(c, poll_s) for c in self.clients))
            found = {c.address: d for c, d in zip(self.clients, answers, strict=True) if d}
            if found:
                return one_model(found)
            await asyncio.sleep(poll_s)

    async def _describe(self, client: SchedulerClient, poll_s: float) -> ModelDescription | None:
        try:
            # The tokenizer JSON is a few MB: more time than a GetStats.
            message = await client.stub.Describe(
                model_pb2.DescribeModelRequest(), timeout=max(10.0, poll_s)
            )
        except grpc.aio.AioRpcError as exc:
            log.info(
                "scheduler not describing its model",
                extra={"scheduler": client.address, "code": exc.code().name},
            )
            return None
        return description_from_proto(message)

    async def _first_answering(self, poll_s: float) -> SchedulerClient:
        """The first scheduler that answers GetStats; retries every poll_s."""
        warned: set[str] = set()
        while True:
            for client in self.clients:
                try:
                    stats = await client.stub.GetStats(
                        engine_pb2.GetStatsRequest(), timeout=max(2.0, poll_s)
                    )
                except grpc.aio.AioRpcError as exc:
                    if client.address not in warned:
                        warned.add(client.address)
                        # Expected while the stack starts (the scheduler waits for its
                        # worker to load the model), so not a warning.
                        log.info(
                            "scheduler not answering yet",
                            extra={"scheduler": client.address, "code": exc.code().name},
                        )
                    continue
                client.stats = stats
                log.info(
                    "scheduler answered",
                    extra={
                        "scheduler": client.address,
                        "scheduler_id": stats.scheduler_id,
                        "num_free_blocks": stats.num_free_blocks,
                    },
                )
                return client
            await asyncio.sleep(poll_s)

    async def close(self) -> None:
        for client in self.clients:
            await client.channel.close()
        self.clients.clear()


def _reason(policy: RoutingPolicy, candidates: Sequence[Candidate], index: int) -> str:
    if policy == "round_robin":
        return "round_robin"
    cached = candidates[index].cached_blocks
    if cached > 0 and cached == max(c.cached_blocks for c in candidates):
        return "cached_prefix"
    return "least_loaded"
