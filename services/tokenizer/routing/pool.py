"""The schedulers behind this tokenizer replica: channels, their load, and routing.

At start-up the schedulers pass on the model their workers describe (tokenizer, chat template,
limits: `wait_until_warm`). A background task polls every scheduler's GetStats (`poll_s`): load
for routing, and the block size and worker epoch the prefix index needs. `pick` asks the prefix
index (Redis) how much of the prompt each scheduler holds, then applies the routing policy
(routing.py) to the active schedulers; a request run with a LoRA adapter goes to one whose
stats list the adapter, and its prefix hashes carry the adapter in their salt, as the
scheduler's cache keys do.

dns: entries are resolved again every `resolve_s` by a second task, which applies what
membership.py decides: a joiner gets a channel and enters routing once its GetStats answers; a
leaver leaves routing at once, and its channel closes when its last stream ends (or after
`drain_s`). Membership changes replace `clients`, `routable` and `draining` with new lists,
never edit them, so a caller iterating one across awaits holds a consistent snapshot.

A call on a channel that closes under it ends with a CancelledError (grpc.aio), not an
AioRpcError; `closed_under` tells it from the caller's own task being cancelled.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import socket
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from protos.llmserve.v1 import model_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS
from services.common.internal_auth import internal_channel
from services.common.model_description_proto import description_from_proto
from services.common.prefix_hash import BlockHash, adapter_salt, prefix_block_hashes
from services.contracts.errors import DependencyUnavailableError, NotFoundError, quoted
from services.contracts.model_description import ModelDescription
from services.contracts.sampling_params import SamplingParams
from services.tokenizer import metrics
from services.tokenizer.routing import scheduler_convert
from services.tokenizer.routing.disaggregation import (
    PrefillCandidate,
    choose_prefill,
    takes_requests,
    wants_remote_prefill,
)
from services.tokenizer.routing.membership import MEMBER_STATES, DnsName, Membership, SchedulerEntry
from services.tokenizer.routing.policy import (
    AdapterState,
    Candidate,
    RecentRoutes,
    RoutingPolicy,
    SchedulerLoad,
    choose_scheduler,
)
from services.tokenizer.routing.prefix_fetch import PrefixSource, choose_prefix_source
from services.tokenizer.routing.prefix_locator import MAX_LOOKUP_BLOCKS, PrefixLocator
from services.tokenizer.routing.scheduler_snapshot import SchedulerSnapshot
from services.tokenizer.served_model import one_model

log = logging.getLogger(__name__)

Resolve = Callable[[str, int], Awaitable[Sequence[str]]]
"""(name, port) → the IP addresses `name` resolves to; raises OSError (socket.gaierror) or
TimeoutError when it cannot. The default asks the system resolver; tests inject their own."""

RESOLVE_TIMEOUT_S = 5.0
"""Longest wait for one resolution; then it counts as failed (the last known set stays)."""

STATS_TIMEOUT_S = 1.0
"""Longest wait for one GetStats answer."""
MAX_SLOW_POLLS = 2
"""Consecutive GetStats timeouts over which a scheduler keeps its last stats: a scheduler whose
event loop is busy for a second (a long prefill's step results, a burst of submits) is slow,
not gone, and dropping its stats would take it out of routing and of the prefill pairs. Any
other failure (UNAVAILABLE: down, or its worker is not connected) drops them at once."""


async def resolve_ips(name: str, port: int) -> list[str]:
    """Every A/AAAA address of `name`, sorted (DNS rotates its answers; joins stay in a stable
    order). The lookup runs in the loop's executor: a timed-out one keeps its thread until the
    system resolver gives up, which resolv.conf bounds."""
    loop = asyncio.get_running_loop()
    infos = await loop.getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def closed_under(client: SchedulerClient) -> bool:
    """Whether a CancelledError out of a call on `client` means its channel closed (it left
    the pool), not that the current task is being cancelled."""
    task = asyncio.current_task()
    return client.closed and not (task is not None and task.cancelling())


@dataclass(slots=True)
class SchedulerClient:
    address: str
    channel: grpc.aio.Channel
    stub: scheduler_pb2_grpc.SchedulerStub
    stats: SchedulerSnapshot | None = None
    """The last GetStats answer; None while it does not answer."""
    num_sent_since_poll: int = 0
    num_in_flight: int = 0
    """Submit streams open on it: a scheduler that left closes its channel once none is."""
    num_slow_polls: int = 0
    """Consecutive GetStats timeouts (MAX_SLOW_POLLS)."""
    draining: bool = False
    """It left the pool (gone from DNS): no new request; its streams may finish."""
    closed: bool = False
    """Its channel is closed: no call may start on it."""

    def load(self) -> SchedulerLoad | None:
        if self.stats is None:
            return None
        return SchedulerLoad(
            self.stats.num_running, self.stats.num_waiting, self.num_sent_since_poll
        )


@dataclass(frozen=True, slots=True)
class Route:
    """Where a request goes, and where its prefix's KV may come from."""

    client: SchedulerClient
    prefix_source: PrefixSource | None = None
    """Another scheduler holding more of the prompt's prefix (prefix_fetch.py); None: none."""


class SchedulerPool:
    def __init__(
        self,
        entries: Sequence[SchedulerEntry],
        *,
        policy: RoutingPolicy = "cache_aware",
        locator: PrefixLocator | None = None,
        overload_queued: int = 8,
        poll_s: float = 0.1,
        internal_secret: str | None = None,
        resolve_s: float = 5.0,
        drain_s: float = 30.0,
        resolve: Resolve = resolve_ips,
        disaggregate_min_prompt: int = 512,
        prefix_fetch_min_blocks: int = 0,
    ) -> None:
        self.entries = tuple(entries)
        self.internal_secret = internal_secret
        self.policy = policy
        self.locator = locator
        self.overload_queued = overload_queued
        self.poll_s = poll_s
        self.resolve_s = resolve_s
        self.drain_s = drain_s
        self.resolve = resolve
        self.disaggregate_min_prompt = disaggregate_min_prompt
        self.prefix_fetch_min_blocks = prefix_fetch_min_blocks
        self.membership = Membership(self.entries)
        self.clients: list[SchedulerClient] = []
        """Every member, pending or active, in membership order (pins go to all of them)."""
        self.routable: list[SchedulerClient] = []
        """The active members: what `pick` chooses from."""
        self.draining: list[SchedulerClient] = []
        """Members that left, until their channels close."""
        self._by_address: dict[str, SchedulerClient] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._turn = itertools.count()
        # Apart: a long prompt's prefill choice must not skip a scheduler's turn (round robin).
        self._prefill_turn = itertools.count()
        self._recent = RecentRoutes()

    @property
    def addresses(self) -> tuple[str, ...]:
        """The members' addresses (fixed ones first, then DNS ones as they joined)."""
        return self.membership.addresses

    def open(self) -> None:
        """Creates the fixed schedulers' channels and starts resolving the dns: entries; must
        run on the event loop that will use them. Every call on them carries the stack's
        internal secret, whichever module makes it."""
        self.membership = Membership(self.entries)
        for address in self.membership.addresses:
            self._connect(address)
        self._refresh()
        if self.membership.names:
            self._spawn(self._resolve_forever())

    def _connect(self, address: str) -> None:
        channel = internal_channel(address, self.internal_secret, CHANNEL_OPTIONS)
        self._by_address[address] = SchedulerClient(
            address, channel, scheduler_pb2_grpc.SchedulerStub(channel)
        )

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refresh(self) -> None:
        """New `clients` and `routable` lists from the membership, and the gauge."""
        self.clients = [self._by_address[a] for a in self.membership.addresses]
        self.routable = [self._by_address[a] for a in self.membership.active]
        for state in MEMBER_STATES:
            metrics.SCHEDULERS.labels(state).set(self.membership.count(state))
        metrics.SCHEDULERS.labels("draining").set(len(self.draining))

    async def pick(
        self, prompt_token_ids: Sequence[int], cache_salt: bytes, lora_name: str = ""
    ) -> SchedulerClient:
        """The scheduler for this prompt (run with the LoRA adapter `lora_name`, if named),
        among the active ones; DependencyUnavailableError when none is (every DNS member still
        pending), NotFoundError when none holds the adapter."""
        return (await self.route(prompt_token_ids, cache_salt, lora_name)).client

    async def route(
        self, prompt_token_ids: Sequence[int], cache_salt: bytes, lora_name: str = ""
    ) -> Route:
        """`pick`'s scheduler, with another one to fetch the prefix's KV from when it holds
        at least --prefix-fetch-min-blocks more of it (looked up whatever the policy)."""
        turn = next(self._turn)
        # Prefill pairs take prompts from decode pairs, never requests (disaggregation.py).
        clients = [c for c in self.routable if takes_requests(c.stats.role if c.stats else None)]
        if not clients:
            raise DependencyUnavailableError(
                f"no scheduler is ready ({len(self.clients)} known, none answering yet)"
            )
        adapters = [_adapter_state(client.stats, lora_name) for client in clients]
        if all(state == "missing" for state in adapters):
            raise NotFoundError(
                "model", f"no scheduler in routing holds the LoRA adapter {quoted(lora_name)}"
            )
        if len(clients) == 1:
            metrics.ROUTED.labels(self.policy, "only").inc()
            return Route(clients[0])
        cached = [0] * len(clients)
        hashes: list[BlockHash] = []
        if self.policy == "cache_aware" or self.prefix_fetch_min_blocks:
            hashes = self._block_hashes(clients, prompt_token_ids, cache_salt, lora_name)
            cached = self._recent.leading_blocks(hashes, [c.address for c in clients])
            if self.locator is not None and hashes:
                indexed = await self._indexed_blocks(clients, hashes)
                cached = [max(a, b) for a, b in zip(cached, indexed, strict=True)]
        candidates = [
            Candidate(count, client.load(), adapter)
            for count, client, adapter in zip(cached, clients, adapters, strict=True)
        ]
        index = choose_scheduler(
            candidates, self.policy, turn=turn, overload_queued=self.overload_queued
        )
        client = clients[index]
        self._recent.remember(hashes, client.address)
        client.num_sent_since_poll += 1
        metrics.ROUTED.labels(self.policy, _reason(self.policy, candidates, index)).inc()
        # Only schedulers whose stats answer: a fetch from one that does not would fail.
        holders = [n if c.stats else 0 for n, c in zip(cached, clients, strict=True)]
        source = choose_prefix_source(
            holders, [c.address for c in clients], index, self.prefix_fetch_min_blocks
        )
        return Route(client, source)

    def pick_prefill(self, num_prompt_tokens: int, sampling: SamplingParams) -> str:
        """The prefill scheduler for this request's prompt (docs/disaggregation.md), or ""
        when the prompt is short, the request cannot use one, or no prefill pair answers."""
        if not wants_remote_prefill(num_prompt_tokens, sampling, self.disaggregate_min_prompt):
            return ""
        candidates = [
            PrefillCandidate(c.address, c.stats.role if c.stats else None, c.load())
            for c in self.routable
        ]
        address = choose_prefill(candidates, next(self._prefill_turn))
        if address is None:
            return ""
        self._by_address[address].num_sent_since_poll += 1
        return address

    def _block_hashes(
        self,
        clients: Sequence[SchedulerClient],
        prompt_token_ids: Sequence[int],
        cache_salt: bytes,
        lora_name: str,
    ) -> list[BlockHash]:
        """The prompt's full-block hashes at the schedulers' block size (all serve one model
        with one block size; a scheduler reporting another size never matches), under the
        salt the schedulers cache them with (an adapter's blocks under the adapter's salt)."""
        block_size = next((c.stats.block_size for c in clients if c.stats), 0)
        if not block_size:
            return []
        salt = adapter_salt(cache_salt, lora_name)
        return prefix_block_hashes(prompt_token_ids, block_size, salt, max_blocks=MAX_LOOKUP_BLOCKS)

    async def _indexed_blocks(
        self, clients: Sequence[SchedulerClient], hashes: Sequence[BlockHash]
    ) -> list[int]:
        """Per scheduler: leading blocks the Redis index says it holds (current epoch only)."""
        assert self.locator is not None
        known = [(i, c.stats) for i, c in enumerate(clients) if c.stats is not None]
        found = await self.locator.cached_blocks(
            hashes, [(stats.scheduler_id, stats.worker_epoch) for _, stats in known]
        )
        counts = [0] * len(clients)
        for (i, _), count in zip(known, found, strict=True):
            counts[i] = count
        return counts

    async def poll_forever(self) -> None:
        """Keep every scheduler's stats fresh (routing reads them; never awaited per request).
        A pending scheduler enters routing on its first answer."""
        while True:
            await self.refresh_stats()
            await asyncio.sleep(self.poll_s)

    async def refresh_stats(self) -> None:
        """Read every scheduler's stats now (at most a second each, all at once): after a
        change this replica must see before its next poll (a LoRA adapter loaded)."""
        await asyncio.gather(*(self._poll(client) for client in self.clients))

    async def _poll(self, client: SchedulerClient) -> None:
        if client.closed:
            return
        try:
            answer = await client.stub.GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=STATS_TIMEOUT_S
            )
            stats: SchedulerSnapshot | None = scheduler_convert.scheduler_snapshot(answer)
        except grpc.aio.AioRpcError as exc:
            slow = exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            if slow and client.stats is not None and client.num_slow_polls < MAX_SLOW_POLLS:
                client.num_slow_polls += 1
                return  # its last stats stand, and so do the requests sent since
            stats = None
        except asyncio.CancelledError:
            if closed_under(client):
                return
            raise
        self._answered(client, stats)
        client.num_sent_since_poll = 0
        client.num_slow_polls = 0

    def _answered(self, client: SchedulerClient, stats: SchedulerSnapshot | None) -> None:
        client.stats = stats
        if stats is None or client.draining or not self.membership.answered(client.address):
            return
        log.info(
            "scheduler joined routing",
            extra={"scheduler": client.address, "scheduler_id": stats.scheduler_id},
        )
        self._refresh()

    # ---- discovery ------------------------------------------------------------------------

    async def _resolve_forever(self) -> None:
        """Resolve every dns: entry now, then every resolve_s, and apply the answers."""
        while True:
            answers = await asyncio.gather(*(self._resolve(n) for n in self.membership.names))
            for name, (ips, error) in zip(self.membership.names, answers, strict=True):
                self._apply_resolution(name, ips, error)
            await asyncio.sleep(self.resolve_s)

    async def _resolve(self, name: DnsName) -> tuple[Sequence[str] | None, str]:
        try:
            ips = await asyncio.wait_for(self.resolve(name.name, name.port), RESOLVE_TIMEOUT_S)
        except (OSError, TimeoutError, ValueError) as exc:  # gaierror; a name idna refuses
            return None, str(exc) or type(exc).__name__
        return ips, "" if ips else "no address"

    def _apply_resolution(self, name: DnsName, ips: Sequence[str] | None, error: str = "") -> None:
        """What one resolution of `name` changes (membership.py decides): channels for the
        joiners, out of routing and draining for the leavers."""
        change = self.membership.resolved(name, ips)
        extra = {"scheduler_name": str(name)}
        if change.failure_started:
            log.warning(
                "scheduler name did not resolve: keeping the schedulers known so far",
                extra={**extra, "error": error, "num_schedulers": len(self.clients)},
            )
        if change.recovered:
            log.info("scheduler name resolves again", extra=extra)
        for address in change.joined:
            log.info(
                "scheduler joined, pending until it answers", extra={**extra, "scheduler": address}
            )
            self._connect(address)
        for address in change.left:
            client = self._by_address.pop(address)
            client.draining = True
            self.draining = [*self.draining, client]
            log.info(
                "scheduler left, draining",
                extra={**extra, "scheduler": address, "in_flight": client.num_in_flight},
            )
            self._spawn(self._drain(client))
        if change.joined or change.left:
            self._refresh()

    async def _drain(self, client: SchedulerClient) -> None:
        """Close a leaver's channel once its last stream ends, or after drain_s: a stream
        still open then ends UNAVAILABLE (scheduler_errors.py names the scheduler that left)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.drain_s
        while client.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(self.poll_s)
        if client.num_in_flight:
            log.warning(
                "closing a scheduler that left with requests in flight",
                extra={"scheduler": client.address, "in_flight": client.num_in_flight},
            )
        await self._close_client(client)
        self.draining = [c for c in self.draining if c is not client]
        self._refresh()
        log.info("scheduler drained", extra={"scheduler": client.address})

    async def _close_client(self, client: SchedulerClient) -> None:
        client.closed = True  # before close(): the calls it cancels read it (closed_under)
        await client.channel.close()

    # ---- warm-up ---------------------------------------------------------------------------

    async def wait_until_warm(self, poll_s: float) -> ModelDescription:
        """Waits until a scheduler answers with its worker connected and returns the model
        that worker describes; every scheduler answering by then must serve the same model
        (ModelLoadError otherwise). Retries every poll_s. With dns: entries the first members
        may arrive only now, by the resolver task."""
        while True:
            await self._first_answering(poll_s)
            clients = self.clients
            answers = await asyncio.gather(*(self._describe(c, poll_s) for c in clients))
            found = {c.address: d for c, d in zip(clients, answers, strict=True) if d}
            if found:
                return one_model(found)
            await asyncio.sleep(poll_s)

    async def _describe(self, client: SchedulerClient, poll_s: float) -> ModelDescription | None:
        if client.closed:
            return None
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
        except asyncio.CancelledError:
            if closed_under(client):
                return None
            raise
        return description_from_proto(message)

    async def _first_answering(self, poll_s: float) -> SchedulerClient:
        """The first scheduler that answers GetStats; retries every poll_s (re-reading the
        members: DNS ones join meanwhile)."""
        warned: set[str] = set()
        while True:
            for client in self.clients:
                if client.closed:
                    continue
                try:
                    answer = await client.stub.GetStats(
                        scheduler_pb2.GetStatsRequest(), timeout=max(2.0, poll_s)
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
                except asyncio.CancelledError:
                    if closed_under(client):
                        continue
                    raise
                stats = scheduler_convert.scheduler_snapshot(answer)
                self._answered(client, stats)
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
        """Stops resolving and draining, and closes every channel."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        clients = [*self._by_address.values(), *self.draining]
        self._by_address.clear()
        self.draining = []
        self.clients = []
        self.routable = []
        for client in clients:
            await self._close_client(client)


def _adapter_state(stats: SchedulerSnapshot | None, lora_name: str) -> AdapterState:
    """Where the request's adapter is on this scheduler, as its last stats said (a scheduler
    that did not answer holds none we know of)."""
    if not lora_name:
        return "loaded"
    if stats is None or lora_name not in stats.lora_adapters:
        return "missing"
    return "active" if lora_name in stats.active_lora_adapters else "loaded"


def _reason(policy: RoutingPolicy, candidates: Sequence[Candidate], index: int) -> str:
    if policy == "round_robin":
        return "round_robin"
    cached = candidates[index].cached_blocks
    if cached > 0 and cached == max(c.cached_blocks for c in candidates):
        return "cached_prefix"
    return "least_loaded"
