"""The scheduler's step loop: the pure Scheduler driven against a remote worker.

One long-lived bidirectional Step stream to the worker; each iteration sends a plan and waits
for its result, then hands the events to the requests' queues. If the worker goes away, every
in-flight request fails with WorkerUnavailable, all KV state is dropped (a fresh Scheduler),
and the loop reconnects with backoff.

The worker takes one controller: it accepts a stream (initial metadata, before any plan) or
refuses it (FAILED_PRECONDITION while another stream drives it, e.g. this scheduler's own
previous life, until the worker sees that stream end). The loop reports its worker connected
only once accepted, and retries a refusal like a worker that is down.

The calls themselves, and their protobuf and gRPC, are worker_client.py's.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

from services.common.cache_keys import CacheKeys
from services.contracts.errors import InvalidRequestError, NotFoundError, QueueFullError
from services.contracts.kv_transfer import FAILED_TRANSFER_PREFIX, KvDestination
from services.contracts.lora import LoraAdapterInfo
from services.contracts.step import BatchPlan, StepResult, TokenEvent
from services.contracts.structured_output import StructuredOutput
from services.contracts.worker_description import WorkerDescription
from services.scheduler import lora_metrics, metrics, tenant_metrics
from services.scheduler.features.fair_share import NO_TENANT, Tenant
from services.scheduler.features.lora_registry import LoraRegistry
from services.scheduler.features.pin_keeper import PinKeeper, PromptSource
from services.scheduler.features.retry_hint import StepTimeAverage, retry_after_ms
from services.scheduler.kv_export_waits import ExportWaits
from services.scheduler.kv_handoff import KvHandoffs, PrefillCall, PrefixFetch
from services.scheduler.prefix_index import PrefixIndexPublisher
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.server_config import SchedulerServerConfig
from services.scheduler.stats import SchedulerStats
from services.scheduler.worker_client import (
    GrammarNotPrepared,
    StepStream,
    WorkerClient,
    WorkerRefused,
    WorkerUnavailable,
)

log = logging.getLogger(__name__)

EventQueue = asyncio.Queue[TokenEvent | BaseException]


class StepLoop:
    def __init__(
        self,
        config: SchedulerServerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_connection_change: Callable[[bool], None] | None = None,
        prefix_index: PrefixIndexPublisher | None = None,
        registered_prompts: PromptSource | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.on_connection_change = on_connection_change
        self.prefix_index = prefix_index
        self.pins = PinKeeper(
            self.submit,
            lambda: None if self.scheduler is None else self.scheduler.pins,
            clock,
            registered_prompts,
        )
        self.scheduler: Scheduler | None = None
        self.description: WorkerDescription | None = None
        self._queues: dict[str, EventQueue] = {}
        self._scheduled_at: dict[str, float] = {}
        self._wakeup = asyncio.Event()
        self.connected = asyncio.Event()
        self.num_steps = 0
        self.step_time = StepTimeAverage()
        self._worker: WorkerClient | None = None
        self._grammar_tasks: set[asyncio.Task[None]] = set()
        self._exports = ExportWaits()  # ExportKv calls until their plan's result
        self.loras = LoraRegistry()
        # Disaggregation: prefill calls for requests whose KV comes from a prefill pair.
        self.handoffs = KvHandoffs(
            config.worker_advertise_address or config.worker,
            config.internal_secret,
            config.kv_transfer_timeout_s,
            self._wakeup.set,
        )

    # ---- the server's calls --------------------------------------------------------------

    def submit(
        self,
        request: Request,
        *,
        tenant: Tenant = NO_TENANT,
        pin_name: str | None = None,
        prefill: PrefillCall | None = None,
        kv_destination: KvDestination | None = None,
        fetch: PrefixFetch | None = None,
    ) -> EventQueue:
        """Queue a request; its events arrive on the returned queue. Raises WorkerUnavailable,
        or the scheduler's typed errors (invalid, queue full with a retry hint, can never
        fit). `tenant`: whose fair share it uses; `pin_name`: a pinning request's (pins.py);
        `prefill`: the prefill pair to compute its prompt's KV; `kv_destination`: where its
        prompt's KV goes (docs/disaggregation.md); `fetch`: the pair whose cache may send its
        prefix's KV, taken while fetching measures cheaper than computing (kv_fetch_cost.py)."""
        if self.scheduler is None or not self.connected.is_set():
            raise WorkerUnavailable(f"worker {self.config.worker} is not connected")
        self.loras.check(request.lora_name)
        spec = request.sampling.structured_output
        if fetch is not None and not self.handoffs.fetch_cost.worth_fetching():
            metrics.KV_FETCHES.labels("declined").inc()
            fetch = None
        source = prefill.prefill_scheduler if prefill is not None else ""
        if fetch is not None:
            source = fetch.source
        try:
            self.scheduler.add_request(
                request,
                tenant=tenant,
                grammar_pending=spec is not None,
                pin_name=pin_name,
                prefill_scheduler=source,
                kv_destination=kv_destination,
                num_prefix_tokens=fetch.num_prefix_tokens if fetch is not None else 0,
            )
        except QueueFullError as exc:
            # The core counts steps; this loop knows how long they take.
            num_steps = self.scheduler.num_steps_until_a_seat_frees()
            hint_ms = retry_after_ms(num_steps, self.step_time.seconds)
            raise QueueFullError(str(exc), retry_after_ms=hint_ms) from None
        queue: EventQueue = asyncio.Queue()
        self._queues[request.request_id] = queue
        if prefill is not None:
            self.handoffs.register(request.request_id, prefill)
        if spec is not None:
            task = asyncio.create_task(self._prepare_grammar(request.request_id, spec))
            self._grammar_tasks.add(task)
            task.add_done_callback(self._grammar_tasks.discard)
        self._wakeup.set()
        return queue

    async def export_kv(
        self, request_id: str, token_ids: list[int], destination: KvDestination
    ) -> int:
        """Send the cached blocks of the prefix `token_ids` to another pair's request
        (features/kv_exports.py); returns the number of blocks once the worker has copied them
        out (its push runs on). Raises WorkerUnavailable, InvalidRequestError, ConflictError."""
        scheduler = self.scheduler
        if scheduler is None or not self.connected.is_set():
            raise WorkerUnavailable(f"worker {self.config.worker} is not connected")
        num_blocks = scheduler.exports.add(request_id, token_ids, destination)
        done = self._exports.wait(request_id)
        self._wakeup.set()
        try:
            await done
        finally:
            self._exports.forget(request_id)
        return num_blocks

    async def _prepare_grammar(self, request_id: str, spec: StructuredOutput) -> None:
        """Have the worker compile the request's grammar (off its step loop; cached per spec)
        while the request waits, then let the scheduler admit it. A spec the worker refuses
        fails the request with INVALID_ARGUMENT (the tokenizer tier has compiled it already,
        so only a client calling the Scheduler API directly gets here)."""
        scheduler, worker = self.scheduler, self._worker
        try:
            if worker is not None:
                await worker.prepare_grammar(spec)
        except InvalidRequestError as exc:
            queue = self._queues.get(request_id)
            if queue is not None:
                queue.put_nowait(exc)
            self.abort(request_id)
            return
        except GrammarNotPrepared as exc:
            # Anything else (a worker restarting, a slow compile): let the request in; the
            # worker compiles it when the sequence arrives, or the request fails with the
            # worker like every other.
            log.warning("grammar not prepared", extra={"request_id": request_id, "error": str(exc)})
        if scheduler is not None and scheduler is self.scheduler:
            scheduler.set_grammar_ready(request_id)
            self._wakeup.set()

    def abort(self, request_id: str) -> None:
        """Free the request's blocks now; the worker drops it with the next plan."""
        self._queues.pop(request_id, None)
        self._scheduled_at.pop(request_id, None)
        self.handoffs.forget(request_id)
        if self.scheduler is not None:
            self.scheduler.abort_request(request_id)
            self._wakeup.set()

    def abort_choice(self, request_id: str, index: int) -> None:
        """Free one choice's blocks now (n > 1); its request's stream goes on."""
        if self.scheduler is not None:
            self.scheduler.abort_choice(request_id, index)
            self._wakeup.set()

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        worker = self._connected_worker()
        info = await self.loras.load(worker, name, path)
        lora_metrics.on_loaded(info)
        return info

    async def unload_lora_adapter(self, name: str) -> None:
        """Returns once no request holds the adapter and the worker has dropped it."""
        await self.loras.unload(self._connected_worker(), name, self._num_holding)
        lora_metrics.on_unloaded(name)

    def _num_holding(self, lora_name: str) -> int:
        scheduler = self.scheduler
        if scheduler is None:
            return 0
        return sum(r.lora_name == lora_name for r in scheduler.requests.values())

    async def list_lora_adapters(self) -> list[LoraAdapterInfo]:
        return await self._connected_worker().list_lora_adapters()

    def _connected_worker(self) -> WorkerClient:
        if self._worker is None or not self.connected.is_set():
            raise WorkerUnavailable(f"worker {self.config.worker} is not connected")
        return self._worker

    def queue_seconds(self, request: Request) -> float | None:
        scheduled = self._scheduled_at.get(request.request_id)
        return None if scheduled is None else scheduled - request.arrival_time

    def stats(self) -> SchedulerStats | None:
        """None until the worker is connected: between its Describe and its step stream a
        scheduler exists but refuses requests, and routing must not see it as serving."""
        if self.scheduler is None or not self.connected.is_set():
            return None
        return self.scheduler.get_stats()

    # ---- the loop ------------------------------------------------------------------------

    async def run(self) -> None:
        """Connect, drive, and reconnect forever (until cancelled)."""
        backoff = 0.05
        refusal_logged: str | None = None
        while True:
            worker = WorkerClient(self.config.worker, self.config.internal_secret)
            try:
                self._worker = worker
                self.description = await worker.describe()
                self.scheduler = Scheduler(
                    self.config.scheduler_config(
                        self.description.block_size,
                        self.description.model.max_model_len,
                        batch_invariant=self.description.batch_invariant,
                    ),
                    self.description.num_kv_blocks,
                    sliding_window=self.description.sliding_window,
                    max_loras=self.description.max_loras,
                    kv_disk_hashes=self.description.kv_disk_block_hashes
                    if self.description.kv_disk_tier
                    else None,
                )
                await self.loras.connect(worker, self.description.max_loras)
                for info in self.loras.adapters.values():
                    lora_metrics.on_loaded(info)
                if self.prefix_index is not None:
                    disk = self.scheduler.disk
                    self.scheduler.kv.pool.listener = self.prefix_index
                    if disk is not None:
                        disk.listener = self.prefix_index
                    self.prefix_index.attach(
                        self.description.worker_epoch,
                        CacheKeys(self.description.model.model_name),
                        self.scheduler.kv.pool.cached_hashes,
                        None if disk is None else disk.hashes,
                    )
                steps = await worker.open_steps()
                refusal_logged = None
                self._set_connected(True)
                restore = asyncio.create_task(self.pins.restore(self.description.model.model_name))
                backoff = 0.05
                # Routine at start-up; losing the worker is what gets logged as an error.
                log.info(
                    "worker connected",
                    extra={
                        "worker": self.config.worker,
                        "kv_blocks": self.description.num_kv_blocks,
                        "sliding_window": self.description.sliding_window,
                        "epoch": self.description.worker_epoch,
                    },
                )
                try:
                    await self._drive(steps)
                finally:
                    restore.cancel()
            except WorkerUnavailable as exc:
                # A worker that answers but will not be driven by this scheduler (another
                # controller, a wrong secret), told from a worker that is down.
                refusal = exc.reason if isinstance(exc, WorkerRefused) else None
                if self.connected.is_set():
                    log.error(
                        "worker lost", extra={"worker": self.config.worker, "error": str(exc)}
                    )
                elif refusal is not None and refusal != refusal_logged:
                    # Once per kind until connected: a restarted scheduler may be refused for
                    # a few seconds; a wrong secret or a second scheduler, until fixed.
                    refusal_logged = refusal
                    log.warning(
                        "worker refused the step stream; retrying",
                        extra={"worker": self.config.worker, "error": str(exc)},
                    )
                self._fail_all(f"worker {self.config.worker} is unavailable")
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self.config.reconnect_max_s)
            finally:
                self._worker = None
                self._set_connected(False)
                await worker.close()

    async def _drive(self, steps: StepStream) -> None:
        """Plans out, results in, in order. Overlapped: up to two plans in flight, so the
        worker already holds plan N+1 when it finishes step N and this loop digests step N
        (events, stops, blocks) while N+1 runs. Serial: one plan in flight."""
        scheduler = self.scheduler
        assert scheduler is not None
        depth = 2 if self.config.scheduling == "overlapped" else 1
        in_flight: deque[BatchPlan] = deque()
        # An idle loop sends nothing, so it would learn of a dead worker only at the next
        # request; the stream's end wakes it instead, and stats stop reporting a stale epoch.
        steps.add_done_callback(self._wakeup.set)
        worker_busy_since = time.perf_counter()
        while True:
            if not in_flight and not scheduler.has_unfinished_requests():
                self._wakeup.clear()
                await self._wakeup.wait()
            if steps.done():
                raise WorkerUnavailable("the worker's step stream ended")
            if len(in_flight) < depth:
                plan = scheduler.schedule(self.clock())
                if handoffs := scheduler.take_handoffs():
                    assert self.description is not None
                    self.handoffs.start(scheduler, handoffs, self.description, self.clock())
                if plan.needs_worker:
                    self._note_scheduled(plan)
                    if not in_flight:
                        worker_busy_since = time.perf_counter()
                    await steps.write(plan)
                    in_flight.append(plan)
                    if len(in_flight) < depth:
                        continue  # make the next plan before waiting for this one
                else:
                    # Nothing for the worker (everything runnable is in flight or waits for
                    # blocks); aborts and expiries still go out now.
                    events = scheduler.update(plan, StepResult(step_id=plan.step_id), self.clock())
                    metrics.on_step(scheduler, plan, events, None)
                    tenant_metrics.on_step(scheduler)
                    self._dispatch(events)
                    if not in_flight:
                        await asyncio.sleep(0.002)  # requests wait for KV blocks: do not spin
                        continue
            result = await steps.read()
            plan = in_flight.popleft()
            if result.step_id != plan.step_id:
                raise WorkerUnavailable(
                    f"the worker answered step {result.step_id}, expected {plan.step_id}"
                )
            # The worker's time on this step: from when it could start it (sent, or the end
            # of the step before) to its result.
            finished_at = time.perf_counter()
            step_s = finished_at - worker_busy_since
            worker_busy_since = finished_at
            self.num_steps += 1
            if plan.num_scheduled_tokens:  # a plan of drops only is no step time
                self.step_time.observe(step_s)
                self.handoffs.fetch_cost.observe_step(plan.total_num_scheduled_tokens, step_s)
            scheduler.observe_step(plan, result, step_s)
            self._exports.on_result(plan, result)
            events = scheduler.update(plan, result, self.clock())
            if scheduler.failures:
                self._fail_requests(scheduler)
            metrics.on_step(scheduler, plan, events, step_s)
            tenant_metrics.on_step(scheduler)
            metrics.on_drafts(result)
            self._dispatch(events)

    def _note_scheduled(self, plan: BatchPlan) -> None:
        now = self.clock()
        for seq in plan.new_sequences:
            if seq.request_id in self._queues:  # not a forked choice: its request's is set
                self._scheduled_at.setdefault(seq.request_id, now)

    def _dispatch(self, events: list[TokenEvent]) -> None:
        self.handoffs.on_events(events)
        for event in events:
            queue = self._queues.get(event.request_id)
            if event.request_finished:
                self._queues.pop(event.request_id, None)
                log.info(
                    "finished",
                    extra={"request_id": event.request_id, "finish_reason": event.finish_reason},
                )
            if queue is not None:
                queue.put_nowait(event)

    def _fail_requests(self, scheduler: Scheduler) -> None:
        """Requests the worker could not run (their LoRA adapter left it): each owner hears
        NOT_FOUND, or UNAVAILABLE for a prompt whose KV could not reach its decode pair; their
        abort events, out with the next update, find no queue."""
        failures = dict(scheduler.failures)
        scheduler.failures.clear()
        for request_id, reason in failures.items():
            log.warning("request failed", extra={"request_id": request_id, "error": reason})
            queue = self._queues.pop(request_id, None)
            if queue is None:
                continue
            if reason.startswith(FAILED_TRANSFER_PREFIX):
                queue.put_nowait(WorkerUnavailable(reason))
            else:
                queue.put_nowait(NotFoundError("model", reason.partition(": ")[2] or reason))

    def _fail_all(self, message: str) -> None:
        """Every in-flight request ends (the server maps this to UNAVAILABLE); KV is dropped."""
        for queue in self._queues.values():
            queue.put_nowait(WorkerUnavailable(message))
        self._queues.clear()
        self._scheduled_at.clear()
        self.handoffs.clear()
        self._exports.fail_all(message)
        self.scheduler = None
        if self.prefix_index is not None:
            self.prefix_index.detach()

    def _set_connected(self, connected: bool) -> None:
        if connected == self.connected.is_set():
            return
        if connected:
            self.connected.set()
        else:
            self.connected.clear()
        if self.on_connection_change is not None:
            self.on_connection_change(connected)
