"""The public llmserve.v1.TextGeneration API over gRPC: authenticates the caller, converts
protobuf at the edge, runs the shared pipeline (generation.Generator) and maps our typed errors
to status codes (grpc_server.status_for).

Leaving a Generate stream (the client went away, an error) closes the pipeline's stream, which
cancels the scheduler call: the scheduler's signal to free the request's KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from protos.llmserve.v1 import lora_pb2, text_pb2, text_pb2_grpc
from services.common.grpc_server import refusal_metadata, status_for
from services.common.named_prompt import NamedPrompt
from services.common.prompt_checks import check_token_ids
from services.contracts.errors import InvalidRequestError, LLMServeError, shortened
from services.tokenizer import convert, metrics
from services.tokenizer.access.keys import (
    OPEN_CALLER,
    AccessPolicy,
    Caller,
    acting_for,
    require_admin,
    tenant_for,
)
from services.tokenizer.generation import Generator
from services.tokenizer.routing import scheduler_convert
from services.tokenizer.routing.pool import SchedulerClient
from services.tokenizer.validation import (
    MAX_REQUEST_ID_LEN,
    GenerateInput,
    check_prompt_size,
    check_text_size,
)

log = logging.getLogger(__name__)

SERVICE_NAME = text_pb2.DESCRIPTOR.services_by_name["TextGeneration"].full_name

MAX_STATUS_MESSAGE_CHARS = 1024
"""A status message travels in a header (8 KB for all of them by default). Our messages quote
at most a short prefix of the client's input; this bounds any that would not."""


class TextGenerationServicer(text_pb2_grpc.TextGenerationServicer):
    def __init__(self, generator: Generator, access: AccessPolicy | None = None) -> None:
        self._generator = generator
        self._access = access or AccessPolicy()

    async def _caller(self, context: grpc.aio.ServicerContext) -> Caller:
        """The authenticated caller, once the tier is ready (else UNAVAILABLE)."""
        try:
            if self._access.open:
                caller = OPEN_CALLER
            else:
                metadata = dict(context.invocation_metadata() or ())
                caller = self._access.authenticate(metadata.get("authorization"))
            self._generator.model  # noqa: B018 - raises while the tier is loading
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        return caller

    async def Generate(
        self, request: text_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[text_pb2.GenerateResponse]:
        arrival_unix_s = time.time()
        started = time.perf_counter()
        request_metrics = metrics.GenerateMetrics(started)
        context.add_done_callback(lambda _: request_metrics.done(metrics.status_name(context)))
        caller = await self._caller(context)
        try:
            generate_input = convert.generate_input(request)
            generate_input = acting_for(generate_input, caller)
            prepared = await self._generator.prepare(
                generate_input,
                time_remaining_s=context.time_remaining(),
                arrival_unix_s=arrival_unix_s,
                started=started,
                caller=caller,
            )
        except LLMServeError as exc:
            code, message = status_for(exc)
            request_id = shortened(request.request_id, MAX_REQUEST_ID_LEN)
            log.info("rejected", extra={"request_id": request_id, "error": message})
            metrics.on_rejected(exc)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                # A key over its limit: which refusal, and when to retry.
                context.set_trailing_metadata(refusal_metadata(exc))
            await _abort(context, code, message)
        request_id = prepared.request.request_id
        stream = self._generator.stream(prepared)
        # A cancelled stream paused at `yield` gets no CancelledError (grpc 1.85): end the
        # scheduler call when the RPC ends, however it ends.
        context.add_done_callback(lambda _: stream.cancel())
        deltas = stream.deltas()
        try:
            async for delta in deltas:
                request_metrics.on_tokens(len(delta.token_ids))
                if delta.finish_reason:
                    request_metrics.finish_reason = delta.finish_reason
                yield convert.generate_response(request_id, delta)
        except LLMServeError as exc:
            code, message = status_for(exc)
            if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                # The scheduler's reason and retry pushback, passed on as it sent them.
                context.set_trailing_metadata(refusal_metadata(exc))
            await _abort(context, code, message)
        finally:
            await deltas.aclose()

    async def Tokenize(
        self, request: text_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.TokenizeResponse:
        await self._caller(context)
        tokenizer, limits = self._generator.model.tokenizer, self._generator.limits
        try:
            if request.text and request.messages:
                raise InvalidRequestError("text", "set either text or messages, not both")
            # Text no context could hold is refused before the tokenizer sees it, as at
            # Generate; text that merely overflows the context is counted.
            if request.messages:
                messages = convert.chat_messages(request.messages)
                check_prompt_size(GenerateInput(messages=messages), limits)
                token_ids = tokenizer.apply_chat_template(messages)
            else:
                check_text_size("text", len(request.text), limits)
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
        await self._caller(context)
        model = self._generator.model
        try:
            # No sequence is longer than the context: more ids are no text we produced.
            if len(request.token_ids) > model.max_model_len:
                raise InvalidRequestError(
                    "token_ids",
                    f"has {len(request.token_ids)} ids; the context holds {model.max_model_len}",
                )
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
        caller = await self._caller(context)
        prompts = self._generator.prompts
        try:
            require_admin(caller, "RegisterPrompt")
            prompt = prompts.build(
                request.name, request.system_prompt, request.ttl_s, request.tenant_id
            )
            await prompts.save(prompt)
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
                "key_id": caller.key_id,
            },
        )
        return convert.registered_prompt(prompt, num_pinned)

    async def _pin_everywhere(self, prompt: NamedPrompt) -> int:
        """Pin the prompt's KV on every scheduler; returns how many pinned some of it. A
        scheduler that is down now pins it from Redis when it comes back."""
        pin = scheduler_convert.pin_request(prompt)
        timeout_s = self._generator.config.pin_timeout_s

        async def pin_on(client: SchedulerClient) -> bool:
            try:
                response = await client.stub.Pin(pin, timeout=timeout_s)
            except grpc.aio.AioRpcError as exc:
                log.warning(
                    "pin failed",
                    extra={"scheduler": client.address, "code": exc.code().name},
                )
                return False
            return response.num_pinned_tokens > 0

        # A scheduler leaving the pool mid-call (its channel closed) ends its call with a
        # CancelledError, not a status: it counts as not pinned, like one that is down.
        results = await asyncio.gather(
            *(pin_on(c) for c in self._generator.pool.clients), return_exceptions=True
        )
        return sum(result is True for result in results)

    async def ListPrompts(
        self, request: text_pb2.ListPromptsRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.ListPromptsResponse:
        caller = await self._caller(context)
        try:
            tenant_id = tenant_for(caller, request.tenant_id)
            prompts = await self._generator.prompts.list(tenant_id)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        return text_pb2.ListPromptsResponse(prompts=[convert.registered_prompt(p) for p in prompts])

    async def DeletePrompt(
        self, request: text_pb2.DeletePromptRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.DeletePromptResponse:
        caller = await self._caller(context)
        try:
            require_admin(caller, "DeletePrompt")
            deleted = await self._generator.prompts.delete(request.tenant_id, request.name)
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        unpin = scheduler_convert.unpin_request(request.tenant_id, request.name)
        await asyncio.gather(
            *(c.stub.Unpin(unpin, timeout=5.0) for c in self._generator.pool.clients),
            return_exceptions=True,
        )
        log.info(
            "prompt deleted",
            extra={"prompt_name": request.name, "deleted": deleted, "key_id": caller.key_id},
        )
        return text_pb2.DeletePromptResponse(deleted=deleted)

    async def ListModels(
        self, request: text_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> text_pb2.ListModelsResponse:
        """The served model, then each LoRA adapter a scheduler holds (its parent set)."""
        await self._caller(context)
        model = self._generator.model
        stats = next((c.stats for c in self._generator.pool.clients if c.stats is not None), None)
        names = [model.name, *self._generator.adapters.listed(model.name)]
        infos = [
            convert.model_info(
                name,
                model.max_model_len,
                model.vocab_size,
                stats,
                parent="" if name == model.name else model.name,
            )
            for name in names
        ]
        return text_pb2.ListModelsResponse(models=infos)

    # ---- LoRA adapters (lora_adapters.py: the calls to every scheduler, their answers merged)

    async def LoadLoraAdapter(
        self, request: lora_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.LoraAdapterInfo:
        caller = await self._caller(context)
        try:
            require_admin(caller, "LoadLoraAdapter")
            info = await self._generator.adapters.load(
                request.name,
                request.path,
                self._generator.model.name,
                timeout_s=context.time_remaining(),
            )
        except LLMServeError as exc:
            log.info("lora adapter not loaded", extra={"error": str(exc), "key_id": caller.key_id})
            await _abort(context, *status_for(exc))
        log.info(
            "lora adapter loaded",
            extra={
                "lora_name": info.name,
                "schedulers": info.num_loaded_schedulers,
                "key_id": caller.key_id,
            },
        )
        return convert.lora_adapter_info(info)

    async def UnloadLoraAdapter(
        self, request: lora_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.UnloadLoraAdapterResponse:
        caller = await self._caller(context)
        try:
            require_admin(caller, "UnloadLoraAdapter")
            num_unloaded = await self._generator.adapters.unload(
                request.name, timeout_s=context.time_remaining()
            )
        except LLMServeError as exc:
            log.info(
                "lora adapter not unloaded", extra={"error": str(exc), "key_id": caller.key_id}
            )
            await _abort(context, *status_for(exc))
        log.info(
            "lora adapter unloaded",
            extra={"lora_name": request.name, "schedulers": num_unloaded, "key_id": caller.key_id},
        )
        return lora_pb2.UnloadLoraAdapterResponse(num_unloaded_schedulers=num_unloaded)

    async def ListLoraAdapters(
        self, request: lora_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.ListLoraAdaptersResponse:
        """Any key may list them, as any key may list models."""
        await self._caller(context)
        try:
            infos = await self._generator.adapters.describe(
                self._generator.model.name, timeout_s=context.time_remaining()
            )
        except LLMServeError as exc:
            await _abort(context, *status_for(exc))
        return lora_pb2.ListLoraAdaptersResponse(
            adapters=[convert.lora_adapter_info(info) for info in infos]
        )


async def _abort(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str
) -> NoReturn:
    await context.abort(code, shortened(message, MAX_STATUS_MESSAGE_CHARS))
    raise AssertionError("context.abort returned")  # it raises; this tells the type checker
