"""The tokenizer tier: serves the public llmserve.v1.TextGeneration API.

Everything textual happens here. One Generate call:

    validate (no scheduler call for a bad request) → token ids (chat template for messages)
    → Engine.Submit on a scheduler, timeout = the remaining budget
    → per SubmitResponse: incremental detokenize → stop strings → GenerateResponse delta
    → last message: finish_reason, usage, timings

Leaving the Submit stream (a stop string matched, the client went away, an error) cancels
the engine call, which is how the scheduler learns to free the request's KV blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import grpc

from protos.llmserve.v1 import engine_pb2, text_pb2, text_pb2_grpc
from services.common.cache_keys import CacheKeys
from services.common.config_flags import add_config_flags, config_from_args
from services.common.errors import InvalidRequestError, LLMServeError
from services.common.grpc_server import GrpcService, run_service, status_for
from services.common.metrics_http import start_metrics_server
from services.common.model_tokenizer import ModelTokenizer
from services.common.named_prompt import NamedPrompt, pin_name
from services.common.prefix_hash import tenant_salt
from services.common.prompt_checks import check_token_ids
from services.common.prompt_store import PromptStore
from services.common.redis_store import open_store
from services.tokenizer import convert, metrics
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.detokenizer import IncrementalDetokenizer
from services.tokenizer.named_prompts import PromptRegistry, system_turn
from services.tokenizer.prefix_locator import PrefixLocator
from services.tokenizer.scheduler_pool import SchedulerClient, SchedulerPool
from services.tokenizer.stop_strings import StopStringMatcher
from services.tokenizer.validation import Limits, validate_generate

log = logging.getLogger(__name__)

SERVICE_NAME = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name

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
# The engine's finish reasons that end the stream normally, as the public API names them.
_PUBLIC_FINISH_REASONS = frozenset({"stop", "length", "abort"})


# ---- the model this tier serves ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The tokenizer plus what the edge checks need to know about the model."""

    name: str
    tokenizer: ModelTokenizer
    max_model_len: int
    vocab_size: int

    def limits(self, config: TokenizerConfig) -> Limits:
        return Limits(
            model_name=self.name,
            max_model_len=self.max_model_len,
            vocab_size=self.vocab_size,
            max_new_tokens_limit=config.max_new_tokens_limit or self.max_model_len,
            max_stop_strings=config.max_stop_strings,
            max_stop_string_len=config.max_stop_string_len,
        )


def load_served_model(config: TokenizerConfig) -> ServedModel:
    """Reads the tokenizer and the context length from the model file's metadata, without
    torch and without the weights (slow for a GGUF file: seconds to parse the token list)."""
    from services.common.model_source import model_display_name, resolve_model_path
    from services.contracts.model_config import read_model_config

    path = resolve_model_path(config.model)
    tokenizer = ModelTokenizer.from_path(path)
    model_config = read_model_config(path)
    context_length = model_config.max_position_embeddings
    max_model_len = min(config.max_model_len or context_length, context_length)
    return ServedModel(model_display_name(path), tokenizer, max_model_len, model_config.vocab_size)


# ---- text out: whole characters, never a stop string --------------------------------------


@dataclass(frozen=True, slots=True)
class TextStep:
    text: str
    """Text that may be sent now."""
    stopped: bool = False
    """A stop string matched: the stream ends here and no later text may be sent."""


class OutputText:
    """One request's generated ids → text that is safe to send (pure; no gRPC).

    The detokenizer holds back incomplete UTF-8 characters; the stop matcher then holds back
    any suffix that could still grow into a stop string, and drops the stop and what follows.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: Sequence[int], stop: Sequence[str]
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(stop) if stop else None

    def add(self, token_ids: Sequence[int]) -> TextStep:
        return self._match(self._detokenizer.add(token_ids))

    def finish(self) -> TextStep:
        """The end of the stream: flush both hold-back buffers (a stop may still match)."""
        step = self._match(self._detokenizer.finish())
        if step.stopped or self._stops is None:
            return step
        return TextStep(step.text + self._stops.flush())

    def _match(self, delta: str) -> TextStep:
        if self._stops is None:
            return TextStep(delta)
        result = self._stops.feed(delta)
        return TextStep(result.text, result.stopped)


# ---- schedulers ---------------------------------------------------------------------------


def remaining_budget(time_remaining_s: float | None, deadline_s: float | None) -> float | None:
    """The timeout for the next hop: the tighter of the caller's gRPC deadline and deadline_ms."""
    budgets = [b for b in (time_remaining_s, deadline_s) if b is not None]
    return min(budgets) if budgets else None


# ---- the public service -------------------------------------------------------------------


@dataclass(slots=True)
class _Progress:
    """Counters of one Generate call, for usage, timings and logs."""

    num_prompt_tokens: int
    started: float
    num_completion_tokens: int = 0
    num_cached_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None

    def observe(self, response: engine_pb2.SubmitResponse) -> None:
        if response.queue_ms:
            self.queue_ms = response.queue_ms
        if response.num_cached_tokens:
            self.num_cached_tokens = response.num_cached_tokens
        if response.num_prompt_tokens:
            self.num_prompt_tokens = response.num_prompt_tokens

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000.0

    def sending(self, num_token_ids: int) -> None:
        self.num_completion_tokens += num_token_ids
        if self.ttft_ms is None and num_token_ids:
            self.ttft_ms = self.elapsed_ms()


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
        progress = _Progress(len(validated.prompt_token_ids), started)
        output = OutputText(model.tokenizer.tokenizer, validated.prompt_token_ids, validated.stop)
        # The client may be slower than the engine. Read the engine stream at once into a
        # local queue: a stalled client must never stall the shared scheduler connection
        # (HTTP/2 flow control is per connection too), and a backlog goes out coalesced.
        responses: asyncio.Queue[engine_pb2.SubmitResponse | BaseException | None] = asyncio.Queue()
        reader = asyncio.create_task(_drain(call, responses))
        context.add_done_callback(lambda _: call.cancel())
        pending: text_pb2.GenerateResponse | None = None
        try:
            while True:
                item = await responses.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                engine_response = item
                if engine_response.finish_reason == "deadline":
                    log.info("deadline passed in the scheduler", extra=extra)
                    await _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed")
                progress.observe(engine_response)
                request_metrics.on_tokens(len(engine_response.token_ids))
                message = self._step(engine_response, output, progress, request_id)
                if message is None:
                    continue
                if pending is not None:
                    message = _merge(pending, message)
                    pending = None
                if not message.finish_reason and not responses.empty():
                    pending = message
                    continue
                if message.finish_reason:
                    # Cancel before the last send: the scheduler frees the KV sooner.
                    call.cancel()
                    request_metrics.finish_reason = message.finish_reason
                    log.info(
                        "generate done",
                        extra={
                            **extra,
                            "finish_reason": message.finish_reason,
                            "completion_tokens": progress.num_completion_tokens,
                            "ttft_ms": round(progress.ttft_ms or 0.0, 2),
                            "total_ms": round(progress.elapsed_ms(), 2),
                        },
                    )
                    yield message
                    return
                yield message
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

    def _step(
        self,
        engine_response: engine_pb2.SubmitResponse,
        output: OutputText,
        progress: _Progress,
        request_id: str,
    ) -> text_pb2.GenerateResponse | None:
        """One engine message → the public message to send (None: nothing to send yet).

        A message may carry token ids with empty text (half a character, or text held back
        because it may begin a stop string).
        """
        step = output.add(engine_response.token_ids)
        text = step.text
        finish_reason = "stop" if step.stopped else engine_response.finish_reason
        if finish_reason and not step.stopped:
            tail = output.finish()
            text += tail.text
            if tail.stopped:
                finish_reason = "stop"
        message = convert.delta_response(
            request_id, text, engine_response.token_ids, engine_response.logprobs
        )
        progress.sending(len(engine_response.token_ids))
        if not finish_reason:
            return message if (message.text or message.token_ids) else None
        if finish_reason not in _PUBLIC_FINISH_REASONS:
            log.warning(
                "unknown finish reason", extra={"request_id": request_id, "reason": finish_reason}
            )
        total_ms = progress.elapsed_ms()
        return convert.set_final_fields(
            message,
            finish_reason=finish_reason,
            prompt_tokens=progress.num_prompt_tokens,
            completion_tokens=progress.num_completion_tokens,
            cached_prompt_tokens=progress.num_cached_tokens,
            queue_ms=progress.queue_ms,
            ttft_ms=progress.ttft_ms if progress.ttft_ms is not None else total_ms,
            total_ms=total_ms,
        )

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


async def _drain(
    call: grpc.aio.UnaryStreamCall,
    queue: asyncio.Queue[engine_pb2.SubmitResponse | BaseException | None],
) -> None:
    """Move every engine response into `queue`; None marks the end, an exception a failure."""
    try:
        async for response in call:
            queue.put_nowait(response)
        queue.put_nowait(None)
    except grpc.aio.AioRpcError as exc:
        queue.put_nowait(exc)


def _merge(
    first: text_pb2.GenerateResponse, second: text_pb2.GenerateResponse
) -> text_pb2.GenerateResponse:
    """Two deltas as one (the later one's finish fields win)."""
    merged = text_pb2.GenerateResponse()
    merged.CopyFrom(second)
    merged.text = first.text + second.text
    del merged.token_ids[:]
    merged.token_ids.extend([*first.token_ids, *second.token_ids])
    del merged.logprobs[:]
    merged.logprobs.extend([*first.logprobs, *second.logprobs])
    return merged


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


# ---- process ------------------------------------------------------------------------------


class TokenizerServer:
    """The process: GrpcService (health + reflection + drain) around the servicer.

    start() binds and answers at once (health NOT_SERVING, Generate UNAVAILABLE); warm_up()
    loads the tokenizer, waits for a scheduler's GetStats, then turns health SERVING.
    """

    def __init__(self, config: TokenizerConfig, model: ServedModel | None = None) -> None:
        self.config = config
        self.redis = open_store(config.redis_url, metrics.REDIS)
        self.pool = SchedulerPool(
            config.scheduler_addresses,
            policy=config.routing,
            overload_queued=config.route_overload_queued,
            poll_s=config.stats_poll_s,
        )
        self.servicer = TextGenerationServicer(config, self.pool)
        self._poller: asyncio.Task[None] | None = None
        self.service = GrpcService("tokenizer", [SERVICE_NAME])
        self.service.add(text_pb2_grpc.add_TextGenerationServicer_to_server, self.servicer)
        self._preloaded = model

    async def start(self) -> int:
        self.pool.open()
        port = await self.service.start(self.config.host, self.config.port)
        log.info("listening", extra={"host": self.config.host, "port": port})
        return port

    async def warm_up(self) -> None:
        model = self._preloaded
        if model is None:
            started = time.perf_counter()
            # In a thread so health checks are answered (NOT_SERVING) while it loads.
            model = await asyncio.to_thread(load_served_model, self.config)
            log.info(
                "tokenizer loaded",
                extra={
                    "model": model.name,
                    "max_model_len": model.max_model_len,
                    "vocab_size": model.vocab_size,
                    "load_s": round(time.perf_counter() - started, 2),
                },
            )
        prompt_store = None
        if self.redis is not None:
            # Keys are scoped by model, known only now.
            keys = CacheKeys(model.name)
            self.pool.locator = PrefixLocator(self.redis, keys)
            prompt_store = PromptStore(self.redis, keys)
        self.servicer.set_model(model, prompt_store)
        await self.pool.wait_until_warm(self.config.warmup_poll_s)
        self._poller = asyncio.create_task(self.pool.poll_forever())
        await self.service.set_serving(True)
        log.info("serving", extra={"port": self.service.port})

    async def stop(self, drain_s: float) -> None:
        await self.service.drain_and_stop(drain_s)
        if self._poller is not None:
            self._poller.cancel()
        await self.pool.close()
        if self.redis is not None:
            await self.redis.close()


async def serve(config: TokenizerConfig) -> None:
    """Runs until SIGTERM/SIGINT, then drains. A failed warm-up (bad model file) ends it."""
    server = TokenizerServer(config)
    await server.start()
    start_metrics_server(metrics.REGISTRY, config.host, config.metrics_port, "tokenizer")
    warm = asyncio.create_task(server.warm_up())
    signal = asyncio.create_task(server.service.wait_for_signal())
    await asyncio.wait({warm, signal}, return_when=asyncio.FIRST_COMPLETED)
    if warm.done() and warm.exception() is not None:
        signal.cancel()
        await server.stop(0)
        raise warm.exception()  # type: ignore[misc]
    if not warm.done():
        warm.cancel()
    await signal
    await server.stop(config.drain_s)


def cmd_tokenizer(args: argparse.Namespace) -> int:
    config = config_from_args(TokenizerConfig, args)
    # grpc.aio streams, cancellation and health run on uvloop (checked with grpcio 1.85.1
    # and uvloop 0.23: server streaming, client cancel mid-stream, unary calls).
    return run_service(lambda: serve(config))


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "tokenizer", help="serve the public TextGeneration API (the tokenizer tier)"
    )
    add_config_flags(parser, TokenizerConfig)
    parser.set_defaults(func=cmd_tokenizer)
