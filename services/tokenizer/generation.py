"""One Generate call, whichever door it came in by (gRPC TextGeneration or the HTTP doors).

    prepare: the caller's named prompt and the adapters `model` may name (routing/adapters.py)
             → validate (fields, sampling, then token ids: chat template for messages, a
             named prompt first; no scheduler call for a bad request) → the features' steps
             (preparation.py: strict tools, the grammar after the thinking, the grammar's
             compile) → the deadline → a scheduler (routing/pool.py: one holding the prefix
             and the adapter) → the caller's key limits (access/limiter.py), last
    stream:  Scheduler.Submit (routing/submit_stream.py: the call, as EngineOutputs), timeout
             = the remaining budget
             → per SchedulerOutput: output.OutputPipeline (detokenize, stop strings, finish,
               usage); responses a slow client let pile up arrive merged, one per choice
             → OutputDelta, each choice's last one with its finish reason; the stream ends
               when every choice has finished (n > 1: the choices share one scheduler call)

Failures are our typed errors (services.contracts.errors; a scheduler's status becomes one in
routing/scheduler_errors.py), so each door maps them to its own status in one place: a gRPC
code (grpc_server.status_for) or an HTTP status (http/openai/errors.py). Leaving a stream
early (a stop string matched, the client went away, an error) cancels the scheduler call,
which is how the scheduler learns to free the KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

from services.common.grammar import GrammarCompiler
from services.common.prompt_store import PromptStore
from services.contracts.errors import (
    DeadlineExceededError,
    DependencyUnavailableError,
)
from services.tokenizer.access.keys import Caller
from services.tokenizer.access.limiter import Admission, KeyLimiter
from services.tokenizer.access.limits import Quota
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.named_prompts import PromptRegistry, system_turn
from services.tokenizer.output import PUBLIC_FINISH_REASONS, OutputDelta, OutputPipeline
from services.tokenizer.preparation import PreparationStep, preparation_steps
from services.tokenizer.routing.adapters import PoolAdapters
from services.tokenizer.routing.pool import SchedulerClient, SchedulerPool
from services.tokenizer.routing.prefix_fetch import PrefixSource
from services.tokenizer.routing.submit_stream import SubmitStream
from services.tokenizer.served_model import ServedModel
from services.tokenizer.validation import GenerateInput, Limits, ValidatedRequest, validate_generate

# Compiled specs a tokenizer replica keeps: it compiles only to validate, so a repeated schema
# skips the compile; the workers keep their own.
GRAMMAR_CACHE_SIZE = 64

log = logging.getLogger(__name__)


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
    admission: Admission | None = None
    """Its place in its API key's limits (None: the key has none); the stream releases it."""
    prefill_scheduler: str = ""
    """The prefill pair that computes its prompt's KV first (docs/disaggregation.md); empty:
    the scheduler prefills it itself."""
    prefix_source: PrefixSource | None = None
    """Another scheduler holding more of its prefix, to fetch the KV from (prefix_fetch.py)."""

    @property
    def quota(self) -> Quota | None:
        """The key's rpm / tpm use, for the HTTP doors' rate-limit headers."""
        return None if self.admission is None else self.admission.quota


class Generator:
    """The tier's generation pipeline over the scheduler pool, shared by both doors."""

    def __init__(
        self, config: TokenizerConfig, pool: SchedulerPool, limiter: KeyLimiter | None = None
    ) -> None:
        self.config = config
        self.pool = pool
        self.limiter = limiter or KeyLimiter()
        self.adapters = PoolAdapters(pool)
        self._model: ServedModel | None = None
        self._limits: Limits | None = None
        self._prompts: PromptRegistry | None = None
        self._steps: tuple[PreparationStep, ...] = ()

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
        grammars = GrammarCompiler.from_description(
            model.description, cache_size=GRAMMAR_CACHE_SIZE
        )
        self._steps = preparation_steps(model, grammars)
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
        caller: Caller | None = None,
    ) -> Prepared:
        """Check, tokenize and route a request, and admit it for its caller's key limits.
        Raises InvalidRequestError (the field at fault), NotFoundError (model: neither the
        served model nor a loaded LoRA adapter; prompt_name),
        DeadlineExceededError or KeyOverLimitError."""
        arrival_unix_s = time.time() if arrival_unix_s is None else arrival_unix_s
        started = time.perf_counter() if started is None else started
        model, limits = self.model, self.limits
        named_prompt = None
        if generate_input.prompt_name:
            named_prompt = await self.prompts.get(
                generate_input.tenant_id, generate_input.prompt_name
            )
        lora_adapters = await self.adapters.names_for(generate_input.model, model.name)
        validated = validate_generate(
            generate_input, limits, model.tokenizer, named_prompt, lora_adapters
        )
        for step in self._steps:  # the features' own steps (preparation.py)
            validated = await step.apply(validated)
        timeout = remaining_budget(time_remaining_s, validated.deadline_s)
        if timeout is not None and timeout <= 0:
            raise DeadlineExceededError("deadline passed on arrival")
        route = await self.pool.route(
            validated.prompt_token_ids, validated.cache_salt, validated.lora_name
        )
        admission = None
        if caller is not None:
            # Last: a request refused for a bad field or a deadline counts against no limit.
            num_prompt_tokens = len(validated.prompt_token_ids)
            admission = await self.limiter.admit(caller.key_id, caller.limits, num_prompt_tokens)
        prefill = self.pool.pick_prefill(len(validated.prompt_token_ids), validated.sampling)
        return Prepared(
            validated,
            route.client,
            timeout,
            arrival_unix_s,
            started,
            admission,
            prefill,
            route.prefix_source,
        )

    def stream(self, prepared: Prepared) -> GenerationStream:
        """Submit the request; its deltas come from the returned stream."""
        return GenerationStream(prepared, self.model)


class GenerationStream:
    """One request's scheduler call and its output pipeline.

    `deltas()` yields the request's OutputDeltas, the last one with its finish reason.
    `cancel()` ends the scheduler call at once (idempotent, synchronous: safe from a done
    callback); closing `deltas()` early does too.
    """

    def __init__(self, prepared: Prepared, model: ServedModel) -> None:
        self.prepared = prepared
        self._admission = prepared.admission
        if self._admission is not None:
            # However the stream is left, even never read: its key's place is given back.
            weakref.finalize(self, self._admission.release).atexit = False
        request = prepared.request
        self.request_id = request.request_id
        self._extra = {"request_id": request.request_id, "scheduler": prepared.scheduler.address}
        log.info(
            "generate",
            extra={
                **self._extra,
                "prompt_tokens": len(request.prompt_token_ids),
                "timeout_s": prepared.timeout_s,
                "prefill": prepared.prefill_scheduler or None,  # disaggregation.md
            },
        )
        self.output = OutputPipeline.create(
            model.tokenizer.tokenizer,
            request.prompt_token_ids,
            request.stop,
            prepared.started,
            n=request.sampling.n,
            reasoning_parser=model.reasoning_parser if request.is_chat else None,
            tool_request=request.tool_request,
            tool_call_parser=model.tool_call_parser,
        )
        # Read at once, whatever the client's pace: what piles up meanwhile goes through the
        # pipeline as one scheduler output per choice and out as one message.
        self._stream = SubmitStream(
            prepared.scheduler,
            request,
            prepared.arrival_unix_s,
            prepared.timeout_s,
            self._extra,
            prefill_scheduler=prepared.prefill_scheduler,
            prefix_source=prepared.prefix_source,
        )

    def cancel(self) -> None:
        """The scheduler's signal to free the request's KV blocks; the request no longer
        counts against its key's max_concurrent."""
        self._stream.cancel()
        if self._admission is not None:
            self._admission.release()

    def _cancel_choice(self, index: int) -> None:
        """A stop string ended one choice while others go on: the scheduler frees its blocks
        (the last choice's end cancels the whole call instead)."""
        if self.output.num_unfinished == 0:
            return
        self._stream.cancel_choice(index)

    async def deltas(self) -> AsyncIterator[OutputDelta]:
        extra, progress = self._extra, self.output.progress
        address = self.prepared.scheduler.address
        try:
            # None: the stream ended; errors and the deadline finish raise.
            while (outputs := await self._stream.next_outputs()) is not None:
                for scheduler_output in outputs:
                    if self._admission is not None:
                        # Generated tokens count against tpm, sent or not (a stop string).
                        self._admission.on_tokens(len(scheduler_output.token_ids))
                    delta = self.output.step(scheduler_output, time.perf_counter())
                    if delta is None:
                        continue
                    if delta.finish_reason and not scheduler_output.finish_reason:
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
            # cancel the scheduler call: that is the scheduler's signal to free the KV blocks.
            self.cancel()
        log.warning("scheduler stream ended early", extra=extra)
        raise DependencyUnavailableError(
            f"scheduler {address} closed the stream without a finish reason"
        )
