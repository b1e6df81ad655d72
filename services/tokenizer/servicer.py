"""The public llmserve.v1.TextGeneration API: checks and converts at the edge, runs the pure
pipelines, maps errors to status codes.

One Generate call:

    validate (no scheduler call for a bad request) → token ids (chat template for messages)
    → Engine.Submit on a scheduler, timeout = the remaining budget
    → per SubmitResponse: output.OutputPipeline (detokenize, stop strings, finish, usage)
      (the responses a slow client let pile up: merged, through the pipeline once)
    → GenerateResponse

Leaving the Submit stream (a stop string matched, the client went away, an error) cancels
the engine call, which is how the scheduler learns to free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from protos.llmserve.v1 import engine_pb2, text_pb2, text_pb2_grpc
from services.common.errors import InvalidRequestError, LLMServeError
from services.common.grpc_server import status_for
from services.common.named_prompt import NamedPrompt, pin_name
from services.common.prefix_hash import tenant_salt
from services.common.prompt_checks import check_token_ids
from services.common.prompt_store import PromptStore
from services.tokenizer import convert, metrics
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.named_prompts import PromptRegistry, system_turn
from services.tokenizer.output import PUBLIC_FINISH_REASONS, OutputPipeline
from services.tokenizer.scheduler_pool import SchedulerClient, SchedulerPool
from services.tokenizer.served_model import ServedModel
from services.tokenizer.validation import Limits, validate_generate

log = logging.getLogger(__name__)

SERVICE_NAME = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name

# What the reader task passes on from the engine stream: a response, the call's error, or
# None for its end.
EngineItem = engine_pb2.SubmitResponse | BaseException | None

# Scheduler status codes a client can act on pass through unchanged; others become INTERNAL.
_PASS_THROUGH_CODES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.CANCELLED,
        grpc.StatusCode.FAILED_PRECONDITION,
    }
)


def remaining_budget(time_remaining_s: float | None, deadline_s: float | None) -> float | None:
    """The timeout for the next hop: the tighter of the caller's gRPC deadline and deadline_ms."""
    budgets = [b for b in (time_remaining_s, deadline_s) if b is not None]
    return min(budgets) if budgets else None


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    def __init__(self, config: TokenizerConfig, pool: SchedulerPool) -> None:
        self._config = config
        self._pool = pool
        self._model: ServedModel | None = None
        self._limits: Limits | None = None
        self._prompts: PromptRegistry | None = None

    def set_model(self, model: ServedModel, prompt_store: PromptStore | None = None) -> None:
        """Ready to serve `model`; named prompts live in `prompt_store` (None: this replica)."""
        self._model = model
        self._limits = model.limits(self._config)
        tokenizer = model.tokenizer
        self._prompts = PromptRegistry(
            prompt_store,
            lambda text: tokenizer.apply_chat_template(
                system_turn(text), add_generation_prompt=False
            ),
            default_ttl_s=self._config.prompt_ttl_s,
            max_ttl_s=self._config.max_prompt_ttl_s,
            max_model_len=model.max_model_len,
        )

    async def _ready(self, context: grpc.aio.ServicerContext) -> tuple[ServedModel, Limits]:
        if self._model is None or self._limits is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")
        assert self._model is not None and self._limits is not None
        return self._model, self._limits

    async def Generate(
        self, request: text_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        arrival_unix_s = time.time()
        started = time.perf_counter()
        request_metrics = metrics.GenerateMetrics(context, started)
        model, limits = await self._ready(context)
        try:
            generate_input = convert.generate_input(request)
            named_prompt = None
            if generate_input.prompt_name:
                assert self._prompts is not None
                named_prompt = await self._prompts.get(
                    generate_input.tenant_id, generate_input.prompt_name
                )
            validated = validate_generate(generate_input, limits, model.tokenizer, named_prompt)
        except LLMServeError as exc:
            code, message = status_for(exc)
            log.info("rejected", extra={"request_id": request.request_id, "error": message})
            metrics.on_rejected(exc)
            await _abort(context, code, message)
        request_id = validated.request_id
        timeout = remaining_budget(context.time_remaining(), validated.deadline_s)
        if timeout is not None and timeout <= 0:
            await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed on arrival")
        scheduler = await self._pool.pick(validated.prompt_token_ids, validated.cache_salt)
        extra = {"request_id": request_id, "scheduler": scheduler.address}
        log.info(
            "generate",
            extra={**extra, "prompt_tokens": len(validated.prompt_token_ids), "timeout_s": timeout},
        )
        call = scheduler.stub.Submit(
            convert.submit_request(validated, arrival_unix_s), timeout=timeout
        )
        output = OutputPipeline.create(
            model.tokenizer.tokenizer, validated.prompt_token_ids, validated.stop, started
        )
        progress = output.progress
        # The client may be slower than the engine. Read the engine stream at once into a
        # local queue: a stalled client must never stall the shared scheduler connection
        # (HTTP/2 flow control is per connection too). What piles up meanwhile goes through
        # the pipeline as one engine output and out as one message.
        responses: asyncio.Queue[EngineItem] = asyncio.Queue()
        reader = asyncio.create_task(_drain(call, responses))
        context.add_done_callback(lambda _: call.cancel())
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
                    if isinstance(item, BaseException):
                        raise item
                    log.info("deadline passed in the scheduler", extra=extra)
                    await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                engine_output = convert.merged_engine_output(batch)
                request_metrics.on_tokens(len(engine_output.token_ids))
                delta = output.step(engine_output, time.perf_counter())
                if delta is None:
                    continue
                if not delta.finish_reason:
                    yield convert.generate_response(request_id, delta)
                    continue
                if delta.finish_reason not in PUBLIC_FINISH_REASONS:
                    log.warning(
                        "unknown finish reason",
                        extra={"request_id": request_id, "reason": delta.finish_reason},
                    )
                # Cancel before the last send: the scheduler frees the KV sooner.
                call.cancel()
                request_metrics.finish_reason = delta.finish_reason
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
                yield convert.generate_response(request_id, delta)
                return
        except grpc.aio.AioRpcError as exc:
            code, text = _scheduler_error(exc, scheduler.address)
            log.warning("scheduler call failed", extra={**extra, "code": code.name, "error": text})
            await _abort(context, code, text)
        except asyncio.CancelledError:
            log.info("client went away", extra=extra)
            raise
        finally:
            # Leaving the stream for any reason (client gone, stop string, error) must
            # cancel the engine call: that is the scheduler's signal to free the KV blocks.
            call.cancel()
            reader.cancel()
        message = f"scheduler {scheduler.address} closed the stream without a finish reason"
        log.warning("scheduler stream ended early", extra=extra)
        await _abort(context, grpc.StatusCode.UNAVAILABLE, message)

    async def Tokenize(
        self, request: text_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.TokenizeResponse:
        model, _ = await self._ready(context)
        tokenizer = model.tokenizer
        try:
            if request.text and request.messages:
                raise InvalidRequestError("text", "set either text or messages, not both")
            if request.messages:
                token_ids = tokenizer.apply_chat_template(convert.chat_messages(request.messages))
            else:
                token_ids = tokenizer.encode(
                    request.text, add_special_tokens=request.add_special_tokens
                )
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        tokens = [tokenizer.tokenizer.id_to_token(t) or "" for t in token_ids]
        return text_pb2.TokenizeResponse(token_ids=token_ids, tokens=tokens)

    async def Detokenize(
        self, request: text_pb2.DetokenizeRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.DetokenizeResponse:
        model, _ = await self._ready(context)
        try:
            check_token_ids("token_ids", request.token_ids, model.vocab_size)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        text = model.tokenizer.decode(
            request.token_ids, skip_special_tokens=request.skip_special_tokens
        )
        return text_pb2.DetokenizeResponse(text=text)

    async def RegisterPrompt(
        self, request: text_pb2.RegisterPromptRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.RegisteredPrompt:
        await self._ready(context)
        assert self._prompts is not None
        try:
            prompt = self._prompts.build(
                request.name, request.system_prompt, request.ttl_s, request.tenant_id
            )
            await self._prompts.save(prompt)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        num_pinned = await self._pin_everywhere(prompt)
        log.info(
            "prompt registered",
            extra={
                "prompt_name": prompt.name,
                "tokens": len(prompt.token_ids),
                "ttl_s": prompt.ttl_s,
                "pinned_schedulers": num_pinned,
            },
        )
        return convert.registered_prompt(prompt, num_pinned)

    async def _pin_everywhere(self, prompt: NamedPrompt) -> int:
        """Pin the prompt's KV on every scheduler; returns how many pinned some of it. A
        scheduler that is down now pins it from Redis when it comes back."""
        pin = engine_pb2.PinRequest(
            name=pin_name(prompt.tenant_id, prompt.name),
            token_ids=list(prompt.token_ids),
            cache_salt=tenant_salt(prompt.tenant_id),
            ttl_s=float(prompt.ttl_s),
        )

        async def pin_on(client: SchedulerClient) -> bool:
            try:
                response = await client.stub.Pin(pin, timeout=self._config.pin_timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "pin failed",
                    extra={"scheduler": client.address, "code": exc.code().name},
                )
                return False
            return response.num_pinned_tokens > 0

        results = await asyncio.gather(*(pin_on(c) for c in self._pool.clients))
        return sum(results)

    async def ListPrompts(
        self, request: text_pb2.ListPromptsRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.ListPromptsResponse:
        await self._ready(context)
        assert self._prompts is not None
        try:
            prompts = await self._prompts.list(request.tenant_id)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        return text_pb2.ListPromptsResponse(prompts=[convert.registered_prompt(p) for p in prompts])

    async def DeletePrompt(
        self, request: text_pb2.DeletePromptRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.DeletePromptResponse:
        await self._ready(context)
        assert self._prompts is not None
        try:
            deleted = await self._prompts.delete(request.tenant_id, request.name)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        unpin = engine_pb2.UnpinRequest(name=pin_name(request.tenant_id, request.name))
        await asyncio.gather(
            *(c.stub.Unpin(unpin, timeout=5.0) for c in self._pool.clients),
            return_exceptions=True,
        )
        log.info("prompt deleted", extra={"prompt_name": request.name, "deleted": deleted})
        return text_pb2.DeletePromptResponse(deleted=deleted)

    async def ListModels(
        self, request: text_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.ListModelsResponse:
        model, _ = await self._ready(context)
        stats = next((c.stats for c in self._pool.clients if c.stats is not None), None)
        info = convert.model_info(model.name, model.max_model_len, model.vocab_size, stats)
        return text_pb2.ListModelsResponse(models=[info])


def _take_batch(backlog: deque[EngineItem]) -> list[engine_pb2.SubmitResponse]:
    """Pops the leading responses of `backlog` that go through as one: up to the stream's end,
    an error or a deadline finish (left in place), and never past a finished response."""
    batch: list[engine_pb2.SubmitResponse] = []
    while backlog:
        head = backlog[0]
        if not isinstance(head, engine_pb2.SubmitResponse) or head.finish_reason == "deadline":
            break
        backlog.popleft()
        batch.append(head)
        if head.finish_reason:
            break
    return batch


async def _drain(call: grpc.aio.UnaryStreamCall, queue: asyncio.Queue[EngineItem]) -> None:
    """Move every engine response into `queue`; None marks the end, an exception a failure."""
    try:
        async for response in call:
            queue.put_nowait(response)
        queue.put_nowait(None)
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(exc)


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker


def _scheduler_error(exc: grpc.aio.AioRpcError, address: str) -> tuple[grpc.StatusCode, str]:
    code = exc.code()
    if code == grpc.StatusCode.UNAVAILABLE:
        return code, f"scheduler {address} is unavailable: {exc.details()}"
    if code in _PASS_THROUGH_CODES:
        return code, exc.details() or f"scheduler {address}: {code.name}"
    return grpc.StatusCode.INTERNAL, f"scheduler {address} failed: {code.name}: {exc.details()}"
