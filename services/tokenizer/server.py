"""The tokenizer tier's process: its public doors (the gRPC TextGeneration service with
health, reflection and drain; the OpenAI-compatible HTTP API with the Anthropic Messages API
on the same port) over one generation pipeline, the scheduler pool, Redis, API keys and TLS,
and the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from services.common import serving_marker
from services.common.cache_keys import CacheKeys
from services.common.config_flags import add_config_flags, config_from_args
from services.common.grpc_server import GrpcService, run_service
from services.common.metrics_http import start_metrics_server
from services.common.prompt_store import PromptStore
from services.common.redis_store import open_store
from services.text.builtin_chat_templates import chat_template_option
from services.tokenizer import metrics
from services.tokenizer.access.keys import AccessPolicy
from services.tokenizer.access.limiter import KeyLimiter
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.decoding_handlers import add_text_generation_servicer
from services.tokenizer.generation import Generator
from services.tokenizer.http.anthropic import door as anthropic_door
from services.tokenizer.http.anthropic import errors as anthropic_errors
from services.tokenizer.http.anthropic.door import AnthropicDoor, add_anthropic_routes
from services.tokenizer.http.body_limits import BodyLimits
from services.tokenizer.http.common import ErrorAnswer
from services.tokenizer.http.openai import errors as openai_errors
from services.tokenizer.http.openai.app import OpenAIDoor, create_app
from services.tokenizer.http.openai.lora_routes import LoraRoutes, add_lora_routes
from services.tokenizer.http.openai.responses_api.door import ResponsesDoor
from services.tokenizer.http.openai.responses_api.routes import add_responses_routes
from services.tokenizer.http.openai.responses_api.store import open_response_store
from services.tokenizer.http.openai.server import HttpServer
from services.tokenizer.routing.pool import Resolve, SchedulerPool, resolve_ips
from services.tokenizer.routing.prefix_locator import PrefixLocator
from services.tokenizer.served_model import ServedModel
from services.tokenizer.servicer import SERVICE_NAME, TextGenerationServicer

__all__ = ["SERVICE_NAME", "ServedModel", "TokenizerServer", "add_parser", "serve"]

log = logging.getLogger(__name__)


class TokenizerServer:
    """The process: GrpcService (health + reflection + drain) around the servicer, and the
    HTTP door beside it.

    start() binds both doors and answers at once (health NOT_SERVING, Generate UNAVAILABLE,
    HTTP 503); warm_up() waits for a scheduler with a connected worker, builds the tokenizer
    from the model it describes, then turns health SERVING.
    """

    def __init__(self, config: TokenizerConfig, *, resolve: Resolve = resolve_ips) -> None:
        """`resolve`: how dns: scheduler entries are resolved (tests give their own)."""
        self.config = config
        self.redis = open_store(config.redis_url, metrics.REDIS)
        self.pool = SchedulerPool(
            config.scheduler_entries,
            policy=config.routing,
            overload_queued=config.route_overload_queued,
            poll_s=config.stats_poll_s,
            internal_secret=config.internal_secret,
            resolve_s=config.scheduler_resolve_s,
            drain_s=config.drain_s,
            resolve=resolve,
            disaggregate_min_prompt=config.disaggregate_min_prompt,
            prefix_fetch_min_blocks=config.prefix_fetch_min_blocks,
        )
        self.access = AccessPolicy.from_settings(
            config.api_key, config.admin_api_key, config.api_key_file
        )
        # Read and compiled now: a bad --chat-template file stops the start, not a request.
        self.chat_template = (
            chat_template_option(config.chat_template) if config.chat_template else None
        )
        # Per-key limits: counted in Redis when there is one, so every replica sees them.
        self.limiter = KeyLimiter(self.redis)
        self.generator = Generator(config, self.pool, self.limiter)
        self.servicer = TextGenerationServicer(self.generator, self.access)
        self._poller: asyncio.Task[None] | None = None
        self.service = GrpcService("tokenizer", [SERVICE_NAME])
        self.service.add(add_text_generation_servicer, self.servicer)
        self.http: HttpServer | None = None
        if config.http:
            app = create_app(OpenAIDoor(self.generator, self.access))
            add_anthropic_routes(app, AnthropicDoor(self.generator, self.access))
            add_lora_routes(app, LoraRoutes(self.generator, self.access))
            add_responses_routes(
                app, ResponsesDoor(self.generator, self.access, open_response_store(self.redis))
            )
            limited = BodyLimits(
                app,
                max_body_bytes=config.http_max_body_bytes,
                timeout_s=config.http_timeout_s,
                error_for=_door_error,
            )
            self.http = HttpServer(
                limited,
                config.host,
                config.http_port,
                tls_cert=config.tls_cert,
                tls_key=config.tls_key,
                drain_s=config.drain_s,
                timeout_s=config.http_timeout_s,
                max_connections=config.http_max_connections,
            )

    async def start(self) -> int:
        self.pool.open()
        port = await self.service.start(self.config.host, self.config.port, self._credentials())
        http_port = await self.http.start() if self.http is not None else None
        log.info(
            "listening",
            extra={
                "host": self.config.host,
                "port": port,
                "http_port": http_port,
                "tls": self.config.tls,
                "api_keys": self.access.num_keys,
            },
        )
        if self.access.open:
            log.info("no API key configured: the public API is open to anyone who reaches it")
        return port

    def _credentials(self) -> grpc.ServerCredentials | None:
        if self.config.tls_cert is None or self.config.tls_key is None:
            return None
        key = Path(self.config.tls_key).read_bytes()
        chain = Path(self.config.tls_cert).read_bytes()
        return grpc.ssl_server_credentials([(key, chain)])

    async def warm_up(self) -> None:
        description = await self.pool.wait_until_warm(self.config.warmup_poll_s)
        started = time.perf_counter()
        # In a thread so health checks are answered (NOT_SERVING) while it parses.
        model = await asyncio.to_thread(
            ServedModel.from_description,
            description,
            chat_template=self.chat_template,
            reasoning_parser=self.config.reasoning_parser,
            tool_call_parser=self.config.tool_call_parser,
        )
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
        self.generator.set_model(model, prompt_store)
        self._poller = asyncio.create_task(self.pool.poll_forever())
        await self.service.set_serving(True)
        serving_marker.mark_serving()
        log.info("serving", extra={"port": self.service.port})

    async def stop(self, drain_s: float) -> None:
        if self.http is not None:
            # Both doors drain at once: HTTP stops accepting and finishes its streams while
            # gRPC does the same.
            http_stopped = asyncio.create_task(self.http.stop())
            await self.service.drain_and_stop(drain_s)
            await http_stopped
        else:
            await self.service.drain_and_stop(drain_s)
        if self._poller is not None:
            self._poller.cancel()
        await self.pool.close()
        await self.limiter.close()
        if self.redis is not None:
            await self.redis.close()


def _door_error(path: str, status: int, message: str) -> ErrorAnswer:
    """An error refused before any route, in the shape of the door the path belongs to."""
    if anthropic_door.serves(path):
        return anthropic_errors.transport_error(status, message)
    return openai_errors.transport_error(status, message)


async def serve(config: TokenizerConfig) -> None:
    """Runs until SIGTERM/SIGINT, then drains. A failed warm-up (schedulers serving different
    models) ends it."""
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
