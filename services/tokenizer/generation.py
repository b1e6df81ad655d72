"""One Generate call, whichever door it came in by (gRPC TextGeneration or OpenAI HTTP).

    prepare: validate (no scheduler call for a bad request) → token ids (chat template for
             messages, a named prompt first) → a scheduler
    stream:  Engine.Submit, timeout = the remaining budget
             → per SubmitResponse: output.OutputPipeline (detokenize, stop strings, finish,
               usage); responses a slow client let pile up go through it merged, as one
               per choice
             → OutputDelta, each choice's last one with its finish reason; the stream ends
               when every choice has finished (n > 1: the choices share one engine call)

Failures are our typed errors (services.common.errors), so each door maps them to its own
status in one place: a gRPC code (grpc_server.status_for) or an HTTP status
(openai_http.errors). Leaving a stream early (a stop string matched, the client went away, an
error) cancels the engine call, which is how the scheduler learns to free the KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from protos.llmserve.v1 import engine_pb2
from services.common.backlog import take_leading
from services.common.errors import (
    CapacityError,
    DeadlineExceededError,
    DependencyUnavailableError,
    InternalError,
    InvalidRequestError,
    LLMServeError,
    QueueFullError,
)
from services.common.grammar import GrammarCompiler
from services.common.grpc_server import REASON_METADATA_KEY, retry_pushback_ms
from services.common.prompt_store import PromptStore
from services.tokenizer import convert
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.named_prompts import PromptRegistry, system_turn
from services.tokenizer.output import PUBLIC_FINISH_REASONS, OutputDelta, OutputPipeline
from services.tokenizer.scheduler_pool import SchedulerClient, SchedulerPool, closed_under
from services.tokenizer.served_model import ServedModel
from services.tokenizer.validation import GenerateInput, Limits, ValidatedRequest, validate_generate

# Compiled specs a tokenizer replica keeps: it compiles only to validate, so a repeated schema
# skips the compile; the workers keep their own.
GRAMMAR_CACHE_SIZE = 64

log = logging.getLogger(__name__)

# What the reader task passes on from the engine stream: a response, the call's error, or
# None for its end.
EngineItem = engine_pb2.SubmitResponse | BaseException | None


def remaining_budget(time_remaining_s: float | None, deadline_s: float | None) -> float | None:
    """The timeout for the next hop: the tighter of the caller's own deadline (gRPC's) and
    the request's deadline_ms."""
    budgets = [b for b in (time_remaining_s, deadline_s) if b is not None]
    return min(budgets) if budgets else None


@dataclass(frozen=True, slots=True)
class Prepared:
    """A request ready for a scheduler: checked, tokenized, routed."""

    request: ValidatedRequest
    scheduler: SchedulerClient
    timeout_s: float | None
    arrival_unix_s: float
    started: float
    """perf_counter() on arrival: the origin of the TTFT and total timings."""


class Generator:
    """The tier's generation pipeline over the scheduler pool, shared by both doors."""

    def __init__(self, config: TokenizerConfig, pool: SchedulerPool) -> None:
        self.config = config
        self.pool = pool
        self._model: ServedModel | None = None
        self._limits: Limits | None = None
        self._prompts: PromptRegistry | None = None
        self._grammars: GrammarCompiler | None = None

    def set_model(self, model: ServedModel, prompt_store: PromptStore | None = None) -> None:
        """Ready to serve `model`; named prompts live in `prompt_store` (None: this replica)."""
        self._limits = model.limits(self.config)
        tokenizer = model.tokenizer
        self._prompts = PromptRegistry(
            prompt_store,
            lambda text: tokenizer.apply_chat_template(
                system_turn(text), add_generation_prompt=False
            ),
            default_ttl_s=self.config.prompt_ttl_s,
            max_ttl_s=self.config.max_prompt_ttl_s,
            max_model_len=model.max_model_len,
            max_prompt_chars=model.max_prompt_chars,
        )
        self._grammars = GrammarCompiler.from_description(
            model.description, cache_size=GRAMMAR_CACHE_SIZE
        )
        self._model = model

    @property
    def loaded(self) -> bool:
        return self._model is not None

    @property
    def model(self) -> ServedModel:
        """The served model; DependencyUnavailableError while the tier is still loading."""
        if self._model is None:
            raise DependencyUnavailableError("the tokenizer is still loading")
        return self._model

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            raise DependencyUnavailableError("the tokenizer is still loading")
        return self._limits

    @property
    def prompts(self) -> PromptRegistry:
        if self._prompts is None:
            raise DependencyUnavailableError("the tokenizer is still loading")
        return self._prompts

    async def prepare(
        self,
        generate_input: GenerateInput,
        *,
        time_remaining_s: float | None = None,
        arrival_unix_s: float | None = None,
        started: float | None = None,
    ) -> Prepared:
        """Check, tokenize and route a request. Raises InvalidRequestError (the field at
        fault), NotFoundError (model, prompt_name) or DeadlineExceededError."""
        arrival_unix_s = time.time() if arrival_unix_s is None else arrival_unix_s
        started = time.perf_counter() if started is None else started
        model, limits = self.model, self.limits
        named_prompt = None
        if generate_input.prompt_name:
            named_prompt = await self.prompts.get(
                generate_input.tenant_id, generate_input.prompt_name
            )
        validated = validate_generate(generate_input, limits, model.tokenizer, named_prompt)
        await self.check_structured_output(validated)
        timeout = remaining_budget(time_remaining_s, validated.deadline_s)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceededError("deadline passed on arrival")
        scheduler = await self.pool.pick(validated.prompt_token_ids, validated.cache_salt)
        return Prepared(validated, scheduler, timeout, arrival_unix_s, started)

    async def check_structured_output(self, request: ValidatedRequest) -> None:
        """Compile the request's grammar (once per distinct spec, on a thread: a compile takes
        10-100 ms), so that a spec xgrammar refuses never reaches a scheduler. Raises
        InvalidRequestError naming the parameter that carried it."""
        spec = request.sampling.structured_output
        if spec is None or self._grammars is None:
            return
        try:
            await asyncio.to_thread(self._grammars.compile, spec)
        except InvalidRequestError as exc:
            raise InvalidRequestError(request.structured_output_param, exc.message) from None

    def stream(self, prepared: Prepared) -> GenerationStream:
        """Submit the request; its deltas come from the returned stream."""
        return GenerationStream(prepared, self.model)


class GenerationStream:
    """One request's engine call and its output pipeline.

    `deltas()` yields the request's OutputDeltas, the last one with its finish reason.
    `cancel()` ends the engine call at once (idempotent, synchronous: safe from a done
    callback); closing `deltas()` early does too.
    """

    def __init__(self, prepared: Prepared, model: ServedModel) -> None:
        self.prepared = prepared
        request = prepared.request
        self.request_id = request.request_id
        self._extra = {"request_id": request.request_id, "scheduler": prepared.scheduler.address}
        log.info(
            "generate",
            extra={
                **self._extra,
                "prompt_tokens": len(request.prompt_token_ids),
                "timeout_s": prepared.timeout_s,
            },
        )
        scheduler = prepared.scheduler
        # A scheduler that left the pool may have closed its channel after routing chose it
        # (both doors await between the two): that request ends UNAVAILABLE, unsent.
        self._call: grpc.aio.UnaryStreamCall | None = None
        if not scheduler.closed:
            self._call = scheduler.stub.Submit(
                convert.submit_request(request, prepared.arrival_unix_s),
                timeout=prepared.timeout_s,
            )
        self.output = OutputPipeline.create(
            model.tokenizer.tokenizer,
            request.prompt_token_ids,
            request.stop,
            prepared.started,
            n=request.sampling.n,
        )
        # The client may be slower than the engine. Read the engine stream at once into a
        # local queue: a stalled client must never stall the shared scheduler connection
        # (HTTP/2 flow control is per connection too). What piles up meanwhile goes through
        # the pipeline as one engine output and out as one message.
        self._responses: asyncio.Queue[EngineItem] = asyncio.Queue()
        self._reader = asyncio.create_task(_drain(self._call, self._responses, scheduler))
        # The stream is in flight until its reader ends, however it ends (a leaving
        # scheduler's channel closes when none is).
        scheduler.num_in_flight += 1
        self._reader.add_done_callback(lambda _: _release(scheduler))
        self._cancels: set[asyncio.Future[engine_pb2.CancelChoiceResponse]] = set()

    def cancel(self) -> None:
        """The scheduler's signal to free the request's KV blocks."""
        if self._call is not None:
            self._call.cancel()
        self._reader.cancel()

    def _cancel_choice(self, index: int) -> None:
        """A stop string ended one choice while others go on: the scheduler frees its blocks
        (the last choice's end cancels the whole call instead)."""
        if self.output.num_unfinished == 0 or self.prepared.scheduler.closed:
            return
        cancel = self.prepared.scheduler.stub.CancelChoice(
            engine_pb2.CancelChoiceRequest(request_id=self.request_id, index=index), timeout=5.0
        )
        task = asyncio.ensure_future(cancel)
        # Best effort: a failure leaves the choice running until its own stop or length.
        task.add_done_callback(_log_cancel_failure)
        self._cancels.add(task)
        task.add_done_callback(self._cancels.discard)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        extra, progress = self._extra, self.output.progress
        scheduler = self.prepared.scheduler
        address = scheduler.address
        responses = self._responses
        backlog: deque[EngineItem] = deque()
        try:
            while True:
                if not backlog:
                    backlog.append(await responses.get())
                while not responses.empty():
                    backlog.append(responses.get_nowait())
                batch = _take_batch(backlog)
                if not batch:
                    # The end of the stream, an error or the deadline finish; the responses
                    # before it went out already, as they would have one at a time.
                    item = backlog.popleft()
                    if item is None:
                        break
                    if isinstance(item, grpc.aio.AioRpcError):
                        error = scheduler_error(item, address, left=scheduler.draining)
                        log.warning(
                            "scheduler call failed",
                            extra={**extra, "code": item.code().name, "error": str(error)},
                        )
                        raise error
                    if isinstance(item, BaseException):
                        raise item
                    log.info("deadline passed in the scheduler", extra=extra)
                    raise DeadlineExceededError("deadline passed")
                for engine_output in convert.engine_outputs_by_choice(batch):
                    delta = self.output.step(engine_output, time.perf_counter())
                    if delta is None:
                        continue
                    if delta.finish_reason and not engine_output.finish_reason:
                        self._cancel_choice(delta.index)
                    if delta.finish_reason and delta.finish_reason not in PUBLIC_FINISH_REASONS:
                        log.warning(
                            "unknown finish reason",
                            extra={**extra, "reason": delta.finish_reason},
                        )
                    if not delta.ends_stream:
                        yield delta
                        continue
                    # Cancel before the last send: the scheduler frees the KV sooner.
                    self.cancel()
                    log.info(
                        "generate done",
                        extra={
                            **extra,
                            "finish_reason": delta.finish_reason,
                            "completion_tokens": progress.num_completion_tokens,
                            "ttft_ms": round(progress.ttft_ms or 0.0, 2),
                            "total_ms": round(progress.elapsed_ms(time.perf_counter()), 2),
                        },
                    )
                    yield delta
                    return
        except (asyncio.CancelledError, GeneratorExit):
            log.info("client went away", extra=extra)
            raise
        finally:
            # Leaving the stream for any reason (client gone, stop string, error) must
            # cancel the engine call: that is the scheduler's signal to free the KV blocks.
            self.cancel()
        log.warning("scheduler stream ended early", extra=extra)
        raise DependencyUnavailableError(
            f"scheduler {address} closed the stream without a finish reason"
        )


def _log_cancel_failure(task: asyncio.Future[engine_pb2.CancelChoiceResponse]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("cancelling a choice failed", extra={"error": str(task.exception())})


def _take_batch(backlog: deque[EngineItem]) -> list[engine_pb2.SubmitResponse]:
    """Pops the leading responses of `backlog` that go through as one: up to the stream's end,
    an error or a deadline finish (left in place), and never past a finished response."""
    return take_leading(
        backlog,
        mergeable=lambda head: (
            isinstance(head, engine_pb2.SubmitResponse) and head.finish_reason != "deadline"
        ),
        ends_batch=lambda response: bool(response.finish_reason),
    )


async def _drain(
    call: grpc.aio.UnaryStreamCall | None,
    queue: asyncio.Queue[EngineItem],
    scheduler: SchedulerClient,
) -> None:
    """Move every engine response into `queue`; None marks the end, an exception a failure.
    `call` None: it could not be made (the scheduler's channel had closed)."""
    try:
        if call is None:
            queue.put_nowait(scheduler_gone(scheduler))
            return
        async for response in call:
            queue.put_nowait(response)
        queue.put_nowait(None)
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(exc)
    except asyncio.CancelledError:
        if not closed_under(scheduler):
            raise
        # grpc.aio ends a call whose channel closes with a CancelledError, not a status.
        queue.put_nowait(scheduler_gone(scheduler))


def _release(scheduler: SchedulerClient) -> None:
    scheduler.num_in_flight -= 1


def scheduler_gone(scheduler: SchedulerClient) -> DependencyUnavailableError:
    """A stream whose channel closed under it (or before it could start)."""
    if scheduler.draining:
        return DependencyUnavailableError(
            f"scheduler {scheduler.address} left the pool (no longer listed by DNS) before "
            "the request finished; retry"
        )
    return DependencyUnavailableError(
        f"the channel to scheduler {scheduler.address} closed (this tokenizer is stopping); retry"
    )


def scheduler_error(exc: grpc.aio.AioRpcError, address: str, left: bool = False) -> LLMServeError:
    """A failed Submit as our typed error: what the client can act on keeps its meaning
    (retry, back off, fix a field, too late), anything else is internal. `left`: the
    scheduler left the pool (gone from DNS), so a lost connection is that."""
    code, details = exc.code(), exc.details() or ""
    if left and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return DependencyUnavailableError(
            f"scheduler {address} left the pool (no longer listed by DNS) and is unavailable: "
            f"{details}; retry"
        )
    if code == grpc.StatusCode.UNAVAILABLE:
        return DependencyUnavailableError(f"scheduler {address} is unavailable: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        reasons = dict(exc.trailing_metadata() or ())
        if reasons.get(REASON_METADATA_KEY) == "queue_full":
            return QueueFullError(details, retry_pushback_ms(reasons))
        return CapacityError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(details or "deadline passed")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        field, _, message = details.partition(": ")
        return InvalidRequestError(field, message) if message else InvalidRequestError("", details)
    if code == grpc.StatusCode.CANCELLED:
        return DependencyUnavailableError(f"scheduler {address} cancelled the request")
    return InternalError(f"scheduler {address} failed: {code.name}: {details}")
