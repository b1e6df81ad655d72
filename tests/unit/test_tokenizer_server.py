"""The tokenizer tier's servicer over real gRPC on loopback, against a fake Engine servicer
that streams scripted token ids. The tokenizer is the embedded model's real one."""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llmserve.v1 import engine_pb2, engine_pb2_grpc, model_pb2, text_pb2, text_pb2_grpc
from services.common.model_description_proto import description_to_proto
from services.common.model_source import embedded_model_path
from services.common.model_tokenizer import ModelTokenizer
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.server import SERVICE_NAME, ServedModel, TokenizerServer

MAX_MODEL_LEN = 128
TIMEOUT_S = 10.0


def served_model() -> ServedModel:
    """What the tokenizer tier builds from the fake scheduler's Describe answer."""
    tokenizer = ModelTokenizer.from_path(embedded_model_path())
    # A short context keeps the over-length test cheap; vocab as in the model file.
    description = tokenizer.describe(
        model_name="SmolLM2-135M-Instruct",
        vocab_size=tokenizer.vocab_size,
        max_model_len=MAX_MODEL_LEN,
        eos_token_ids=(),
    )
    return ServedModel.from_description(description)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


# ---- the fake scheduler -----------------------------------------------------------------


@dataclass
class FakeEngine(engine_pb2_grpc.EngineServicer):
    """Streams `script` for every Submit and records what it saw."""

    script: list[engine_pb2.SubmitResponse] = field(default_factory=list)
    hold_open: bool = False
    """After the script, keep the stream open until the caller cancels."""
    abort_with: tuple[grpc.StatusCode, str] | None = None
    abort_metadata: tuple[tuple[str, str], ...] = ()
    """Trailing metadata sent with `abort_with`."""
    fail_after_script: tuple[grpc.StatusCode, str] | None = None
    """After the script, end the stream with this status."""
    stats_available: bool = True
    description: model_pb2.ModelDescription | None = None
    """What Describe answers (running_stack sets the served model's)."""
    requests: list[engine_pb2.SubmitRequest] = field(default_factory=list)
    time_remaining: list[float | None] = field(default_factory=list)
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def Submit(
        self, request: engine_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[engine_pb2.SubmitResponse]:
        self.requests.append(request)
        self.time_remaining.append(context.time_remaining())
        if self.abort_with is not None:
            context.set_trailing_metadata(self.abort_metadata)
            await context.abort(*self.abort_with)
        finished = False

        def on_done(_: Any) -> None:
            # The RPC ended before the script did: the caller cancelled. (A servicer suspended
            # at `yield` never sees CancelledError, and context.cancelled() stays False here.)
            if not finished:
                self.cancelled.set()

        context.add_done_callback(on_done)
        for response in self.script:
            yield response
            await asyncio.sleep(0)
        if self.hold_open:
            await asyncio.sleep(3600)
        finished = True
        if self.fail_after_script is not None:
            await context.abort(*self.fail_after_script)

    async def GetStats(
        self, request: engine_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> engine_pb2.EngineStats:
        if not self.stats_available:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        return engine_pb2.EngineStats(scheduler_id="fake", num_free_blocks=100)

    async def Describe(
        self, request: model_pb2.DescribeModelRequest, context: grpc.aio.ServicerContext
    ) -> model_pb2.ModelDescription:
        if not self.stats_available or self.description is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "worker not connected")
        assert self.description is not None
        return self.description


def script_for(
    token_ids: Sequence[int],
    *,
    chunk: int = 1,
    finish_reason: str = "length",
    num_prompt_tokens: int = 0,
    num_cached_tokens: int = 0,
    queue_ms: float = 0.0,
) -> list[engine_pb2.SubmitResponse]:
    """One message per `chunk` ids; the last one carries finish_reason (if any)."""
    ids = list(token_ids)
    messages = [
        engine_pb2.SubmitResponse(token_ids=ids[i : i + chunk]) for i in range(0, len(ids), chunk)
    ]
    messages = messages or [engine_pb2.SubmitResponse()]
    messages[0].queue_ms = queue_ms
    messages[0].num_prompt_tokens = num_prompt_tokens
    messages[0].num_cached_tokens = num_cached_tokens
    messages[-1].finish_reason = finish_reason
    return messages


# ---- the stack under test ---------------------------------------------------------------


@dataclass
class Stack:
    address: str
    server: TokenizerServer
    engines: list[FakeEngine]
    channel: grpc.aio.Channel
    stub: text_pb2_grpc.TextGenerationStub
    health: health_pb2_grpc.HealthStub

    @property
    def engine(self) -> FakeEngine:
        return self.engines[0]

    async def generate(
        self, request: text_pb2.GenerateRequest, timeout: float | None = TIMEOUT_S
    ) -> list[text_pb2.GenerateResponse]:
        return [r async for r in self.stub.Generate(request, timeout=timeout)]

    async def health_status(self) -> int:
        answer = await self.health.Check(
            health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT_S
        )
        return int(answer.status)


@contextlib.asynccontextmanager
async def running_stack(
    model: ServedModel, engines: Sequence[FakeEngine] = (), *, warm: bool = True, **config: Any
) -> AsyncIterator[Stack]:
    engines = list(engines) or [FakeEngine()]
    engine_servers = []
    addresses = []
    for engine in engines:
        if engine.description is None:
            engine.description = description_to_proto(model.description)
        engine_server = grpc.aio.server()
        engine_pb2_grpc.add_EngineServicer_to_server(engine, engine_server)
        addresses.append(f"127.0.0.1:{engine_server.add_insecure_port('127.0.0.1:0')}")
        await engine_server.start()
        engine_servers.append(engine_server)
    config = {"http_port": 0, **config}
    tokenizer_config = TokenizerConfig(
        port=0, scheduler=",".join(addresses), warmup_poll_s=0.02, **config
    )
    server = TokenizerServer(tokenizer_config)
    port = await server.start()
    if warm:
        await asyncio.wait_for(server.warm_up(), TIMEOUT_S)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Stack(
            f"127.0.0.1:{port}",
            server,
            engines,
            channel,
            text_pb2_grpc.TextGenerationStub(channel),
            health_pb2_grpc.HealthStub(channel),
        )
    finally:
        await channel.close()
        await server.stop(0)
        for engine_server in engine_servers:
            await engine_server.stop(0)


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), 30))


def joined_text(responses: Sequence[text_pb2.GenerateResponse]) -> str:
    return "".join(r.text for r in responses)


def joined_ids(responses: Sequence[text_pb2.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


async def rpc_error(awaitable: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await awaitable
    return info.value


# ---- streaming ----------------------------------------------------------------------------

MIXED_TEXT = "The quick brown fox 🦊 jumps over the lazy dog. 日本語のテキスト, café! 👨‍👩‍👧 done"


@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_the_full_decode(model: ServedModel, chunk: int) -> None:
    output_ids = model.tokenizer.encode(MIXED_TEXT)
    engine = FakeEngine(
        script_for(output_ids, chunk=chunk, num_prompt_tokens=7, num_cached_tokens=4, queue_ms=12.5)
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            responses = await stack.generate(
                text_pb2.GenerateRequest(prompt="Tell me a story.", request_id="req-1")
            )
        assert joined_text(responses) == model.tokenizer.decode(output_ids) == MIXED_TEXT
        assert joined_ids(responses) == output_ids
        assert all(r.request_id == "req-1" for r in responses)
        assert all(not r.finish_reason for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == "length"
        assert last.usage.prompt_tokens == 7  # the engine's count wins
        assert last.usage.completion_tokens == len(output_ids)
        assert last.usage.cached_prompt_tokens == 4
        assert last.timings.queue_ms == 12.5
        assert 0 < last.timings.ttft_ms <= last.timings.total_ms
        submitted = engine.requests[0]
        assert submitted.request_id == "req-1"
        assert list(submitted.prompt_token_ids) == model.tokenizer.encode("Tell me a story.")
        assert submitted.arrival_unix_s > 0
        # Unset sampling fields take SamplingParams' defaults.
        assert submitted.sampling.temperature == 1.0
        assert submitted.sampling.top_p == 1.0
        assert submitted.sampling.top_k == -1
        assert submitted.sampling.max_new_tokens == min(256, MAX_MODEL_LEN)
        assert not submitted.sampling.HasField("seed")

    run(scenario)


def test_multibyte_characters_are_never_split(model: ServedModel) -> None:
    text = "🦊🎉 日本 👨‍👩‍👧 ok"
    output_ids = model.tokenizer.encode(text)
    assert len(output_ids) > len(text.split())  # the emoji really span several tokens

    async def scenario() -> None:
        async with running_stack(model, [FakeEngine(script_for(output_ids))]) as stack:
            responses = await stack.generate(text_pb2.GenerateRequest(prompt="emoji please"))
        assert joined_text(responses) == text
        assert all("\ufffd" not in r.text for r in responses)
        # Ids whose character is not complete yet still travel, with empty text.
        assert any(r.token_ids and not r.text for r in responses)

    run(scenario)


def test_chat_messages_use_the_chat_template(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode("Paris.")))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            request = text_pb2.GenerateRequest(
                messages=[
                    text_pb2.ChatMessage(role="system", content="Be brief."),
                    text_pb2.ChatMessage(role="user", content="Capital of France?"),
                ]
            )
            responses = await stack.generate(request)
        assert joined_text(responses) == "Paris."
        from services.common.chat_template import ChatMessage

        expected = model.tokenizer.apply_chat_template(
            [ChatMessage("system", "Be brief."), ChatMessage("user", "Capital of France?")]
        )
        assert list(engine.requests[0].prompt_token_ids) == expected
        assert len(responses[-1].request_id) == 32  # a uuid4 hex when none was given

    run(scenario)


def test_stop_string_across_tokens_is_cut_and_the_engine_call_cancelled(
    model: ServedModel,
) -> None:
    output_ids = model.tokenizer.encode("Hello there, my friend. More text that must not appear.")
    # "my fri" starts inside one token and ends inside another.
    engine = FakeEngine(script_for(output_ids, finish_reason=""), hold_open=True)

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            sampling = text_pb2.SamplingParams(stop=["never matches", "my fri"])
            # No deadline: the engine call can only end because the tier cancels it.
            responses = await stack.generate(
                text_pb2.GenerateRequest(prompt="Say hello.", sampling=sampling), timeout=None
            )
            await asyncio.wait_for(engine.cancelled.wait(), TIMEOUT_S)
        assert joined_text(responses) == "Hello there, "
        assert responses[-1].finish_reason == "stop"
        assert all("my" not in r.text and "More" not in r.text for r in responses)

    run(scenario)


def test_held_back_text_is_released_when_the_stop_does_not_complete(
    model: ServedModel,
) -> None:
    text = "A good friend. The end"
    output_ids = model.tokenizer.encode(text)
    engine = FakeEngine(script_for(output_ids, finish_reason="stop"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            # "friend." starts "friendly" and "The end" starts "The endgame": both held, then
            # released (the second only at the end of the stream).
            sampling = text_pb2.SamplingParams(stop=["friendly", "The endgame"])
            responses = await stack.generate(
                text_pb2.GenerateRequest(prompt="x", sampling=sampling)
            )
        assert joined_text(responses) == text
        assert responses[-1].finish_reason == "stop"

    run(scenario)


# ---- a slow client: what piles up goes out merged ----------------------------------------

# A client whose HTTP/2 window holds about one message: the tier's sends wait for its reads,
# so everything the engine streams meanwhile piles up in the tier (deterministic back-pressure).
SLOW_CLIENT_OPTIONS = [("grpc.http2.lookahead_bytes", 64), ("grpc.http2.bdp_probe", 0)]


async def slow_generate(
    stack: Stack, request: text_pb2.GenerateRequest, pause_s: float = 0.3
) -> tuple[list[text_pb2.GenerateResponse], grpc.StatusCode]:
    """Every message of one Generate call read by a client that pauses before its first read,
    and how the call ended."""
    responses: list[text_pb2.GenerateResponse] = []
    async with grpc.aio.insecure_channel(stack.address, options=SLOW_CLIENT_OPTIONS) as channel:
        call = text_pb2_grpc.TextGenerationStub(channel).Generate(request, timeout=TIMEOUT_S)
        await asyncio.sleep(pause_s)
        try:
            async for response in call:
                responses.append(response)
        except grpc.aio.AioRpcError as error:
            return responses, error.code()
    return responses, grpc.StatusCode.OK


@pytest.mark.parametrize("stop", [(), ("lazy dog", "never matches")])
def test_slow_client_gets_fewer_messages_with_the_same_text_and_ids(
    model: ServedModel, stop: tuple[str, ...]
) -> None:
    output_ids = model.tokenizer.encode(MIXED_TEXT)
    engine = FakeEngine(script_for(output_ids, num_prompt_tokens=7, queue_ms=2.0))

    async def scenario() -> None:
        request = text_pb2.GenerateRequest(
            prompt="Tell me a story.", sampling=text_pb2.SamplingParams(stop=list(stop))
        )
        async with running_stack(model, [engine]) as stack:
            fast = await stack.generate(request)
            slow, code = await slow_generate(stack, request)
        assert code is grpc.StatusCode.OK
        assert joined_text(slow) == joined_text(fast)
        assert joined_ids(slow) == joined_ids(fast)
        # The first message or two, then the backlog as one.
        assert len(slow) <= 4 < len(fast)
        assert slow[-1].finish_reason == fast[-1].finish_reason
        assert slow[-1].usage == fast[-1].usage
        assert slow[-1].timings.queue_ms == 2.0

    run(scenario)


def test_slow_client_gets_the_tokens_before_an_engine_failure(model: ServedModel) -> None:
    output_ids = model.tokenizer.encode("one two three four five")
    engine = FakeEngine(
        script_for(output_ids, finish_reason=""),
        fail_after_script=(grpc.StatusCode.UNAVAILABLE, "worker lost"),
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            responses, code = await slow_generate(stack, text_pb2.GenerateRequest(prompt="x"))
        assert code is grpc.StatusCode.UNAVAILABLE
        assert joined_ids(responses) == output_ids
        assert joined_text(responses) == "one two three four five"

    run(scenario)


def test_client_going_away_cancels_the_engine_call(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode("one two"), finish_reason=""))
    engine.hold_open = True

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            call = stack.stub.Generate(text_pb2.GenerateRequest(prompt="hi"), timeout=TIMEOUT_S)
            first = await call.read()
            assert first.token_ids
            call.cancel()
            await asyncio.wait_for(engine.cancelled.wait(), TIMEOUT_S)

    run(scenario)


def test_engine_abort_finish_reason_is_passed_on(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode("partial"), finish_reason="abort"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            responses = await stack.generate(text_pb2.GenerateRequest(prompt="hi"))
        assert responses[-1].finish_reason == "abort"
        assert joined_text(responses) == "partial"

    run(scenario)


# ---- validation at the edge --------------------------------------------------------------


def _sampling(**fields: Any) -> text_pb2.GenerateRequest:
    return text_pb2.GenerateRequest(prompt="hi", sampling=text_pb2.SamplingParams(**fields))


INVALID_REQUESTS: list[tuple[str, text_pb2.GenerateRequest, str]] = [
    ("no prompt", text_pb2.GenerateRequest(), "prompt:"),
    (
        "prompt and ids",
        text_pb2.GenerateRequest(prompt="hi", prompt_token_ids=[1, 2]),
        "prompt:",
    ),
    (
        "prompt and messages",
        text_pb2.GenerateRequest(
            prompt="hi", messages=[text_pb2.ChatMessage(role="user", content="x")]
        ),
        "prompt:",
    ),
    (
        "over the context",
        text_pb2.GenerateRequest(prompt="word " * (MAX_MODEL_LEN + 10)),
        "prompt: the prompt has",
    ),
    (
        "id outside the vocabulary",
        text_pb2.GenerateRequest(prompt_token_ids=[1, 10**7]),
        "prompt_token_ids:",
    ),
    ("negative id", text_pb2.GenerateRequest(prompt_token_ids=[-1]), "prompt_token_ids:"),
    (
        "unknown role",
        text_pb2.GenerateRequest(
            messages=[
                text_pb2.ChatMessage(role="user", content="x"),
                text_pb2.ChatMessage(role="wizard", content="y"),
            ]
        ),
        "messages[1].role:",
    ),
    ("max_new_tokens 0", _sampling(max_new_tokens=0), "sampling.max_new_tokens:"),
    (
        "max_new_tokens over the limit",
        _sampling(max_new_tokens=MAX_MODEL_LEN + 1),
        "sampling.max_new_tokens:",
    ),
    ("negative temperature", _sampling(temperature=-0.5), "sampling.temperature:"),
    ("NaN temperature", _sampling(temperature=math.nan), "sampling.temperature:"),
    ("top_p 0", _sampling(top_p=0.0), "sampling.top_p:"),
    ("top_p over 1", _sampling(top_p=1.5), "sampling.top_p:"),
    ("top_k -2", _sampling(top_k=-2), "sampling.top_k:"),
    ("min_p over 1", _sampling(min_p=1.5), "sampling.min_p:"),
    ("repetition_penalty 0", _sampling(repetition_penalty=0.0), "sampling.repetition_penalty:"),
    ("presence_penalty 3", _sampling(presence_penalty=3.0), "sampling.presence_penalty:"),
    ("frequency_penalty -3", _sampling(frequency_penalty=-3.0), "sampling.frequency_penalty:"),
    ("too many stops", _sampling(stop=[f"s{i}" for i in range(17)]), "sampling.stop:"),
    ("stop too long", _sampling(stop=["x" * 257]), "sampling.stop:"),
    ("empty stop", _sampling(stop=["ok", ""]), "sampling.stop:"),
    ("stop id outside vocab", _sampling(stop_token_ids=[10**7]), "sampling.stop_token_ids:"),
    ("logprobs 21", _sampling(logprobs=21), "sampling.logprobs:"),
    ("logprobs negative", _sampling(logprobs=-1), "sampling.logprobs:"),
    ("min_new_tokens over max", _sampling(min_new_tokens=9, max_new_tokens=4), "sampling.min"),
]


def test_invalid_requests_never_reach_the_scheduler(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            for name, request, prefix in INVALID_REQUESTS:
                error = await rpc_error(stack.generate(request))
                assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, name
                assert error.details().startswith(prefix), (name, error.details())
            other_model = text_pb2.GenerateRequest(prompt="hi", model="gpt-9")
            error = await rpc_error(stack.generate(other_model))
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("model: unknown model 'gpt-9'")
            assert stack.engine.requests == []

    run(scenario)


# ---- deadlines and errors ------------------------------------------------------------------


def test_deadline_is_passed_to_the_engine_call(model: ServedModel) -> None:
    engine = FakeEngine(script_for(model.tokenizer.encode("ok")))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            await stack.generate(text_pb2.GenerateRequest(prompt="a", deadline_ms=3000), None)
            await stack.generate(text_pb2.GenerateRequest(prompt="b", deadline_ms=60_000), 2.0)
            await stack.generate(text_pb2.GenerateRequest(prompt="c"), None)
        by_deadline_ms, by_grpc_deadline, none = engine.time_remaining
        # gRPC encodes the timeout with rounding; allow a few ms over.
        assert by_deadline_ms is not None and 0 < by_deadline_ms <= 3.05
        assert by_grpc_deadline is not None and 0 < by_grpc_deadline <= 2.05
        assert none is None

    run(scenario)


def test_engine_deadline_finish_is_deadline_exceeded(model: ServedModel) -> None:
    engine = FakeEngine(script_for([], finish_reason="deadline"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED

    run(scenario)


@pytest.mark.parametrize(
    "code",
    [
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.INVALID_ARGUMENT,
    ],
)
def test_scheduler_errors_keep_their_code(model: ServedModel, code: grpc.StatusCode) -> None:
    engine = FakeEngine(abort_with=(code, "scripted failure"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == code
        assert "scripted failure" in error.details()
        if code == grpc.StatusCode.UNAVAILABLE:
            assert "scheduler 127.0.0.1:" in error.details()

    run(scenario)


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
    ],
)
def test_scheduler_errors_reach_http_as_statuses(
    model: ServedModel, code: grpc.StatusCode, status: int
) -> None:
    """The scheduler refuses at Submit: a stream's status waits for its first token, so the
    refusal is the response's status, not an event inside a 200 stream."""
    engine = FakeEngine(abort_with=(code, "scripted failure"))

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
            body = {"model": model.name, "prompt": "a", "stream": True}
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                response = await http.post(url, json=body)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert "scripted failure" in error["message"]
        assert ("retry-after" in response.headers) == (status == 503)

    run(scenario)


@pytest.mark.parametrize(
    ("metadata", "retry_after"),
    [
        ((("llmserve-reason", "queue_full"), ("grpc-retry-pushback-ms", "2500")), "3"),
        ((("llmserve-reason", "queue_full"), ("grpc-retry-pushback-ms", "40")), "1"),
        ((("llmserve-reason", "queue_full"),), "1"),  # a scheduler without an estimate
    ],
)
def test_a_full_queue_passes_the_retry_hint_on_at_both_doors(
    model: ServedModel, metadata: tuple[tuple[str, str], ...], retry_after: str
) -> None:
    """gRPC: the scheduler's reason and pushback reach the client as trailing metadata.
    HTTP: 429 with Retry-After in whole seconds, rounded up, at least 1."""
    engine = FakeEngine(
        abort_with=(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full"), abort_metadata=metadata
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
            assert stack.server.http is not None
            url = f"http://127.0.0.1:{stack.server.http.port}/v1/completions"
            body = {"model": model.name, "prompt": "a", "stream": True}
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                response = await http.post(url, json=body)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata() or ()) == dict(metadata)
        assert response.status_code == 429, response.text
        assert response.json()["error"]["code"] == "queue_full"
        assert response.headers["retry-after"] == retry_after

    run(scenario)


def test_a_prompt_that_never_fits_is_told_apart_from_a_full_queue(model: ServedModel) -> None:
    engine = FakeEngine(
        abort_with=(grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 90 blocks, 64 exist"),
        abort_metadata=(("llmserve-reason", "prompt_too_long"),),
    )

    async def scenario() -> None:
        async with running_stack(model, [engine]) as stack:
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(error.trailing_metadata() or ()) == {"llmserve-reason": "prompt_too_long"}

    run(scenario)


def test_http_ready_only_once_warm(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model, warm=False) as stack:
            assert stack.server.http is not None
            base = f"http://127.0.0.1:{stack.server.http.port}"
            async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
                assert (await http.get(f"{base}/health")).status_code == 200
                cold = await http.get(f"{base}/ready")
                loading = await http.post(
                    f"{base}/v1/completions", json={"model": model.name, "prompt": "a"}
                )
                await asyncio.wait_for(stack.server.warm_up(), TIMEOUT_S)
                await asyncio.sleep(0.3)  # a stats poll marks the scheduler as answering
                warm = await http.get(f"{base}/ready")
        assert cold.status_code == 503 and cold.headers["retry-after"] == "1"
        assert loading.status_code == 503
        assert "still loading" in loading.json()["error"]["message"]
        assert warm.status_code == 200

    run(scenario)


def test_unreachable_scheduler_is_unavailable(model: ServedModel) -> None:
    async def scenario() -> None:
        # Warm against a live fake, then point the pool at a port nobody listens on.
        async with running_stack(model) as stack:
            await stack.server.pool.close()
            stack.server.pool.entries = ("127.0.0.1:1",)
            stack.server.pool.open()
            error = await rpc_error(stack.generate(text_pb2.GenerateRequest(prompt="a")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "scheduler 127.0.0.1:1" in error.details()

    run(scenario)


def test_requests_go_round_robin(model: ServedModel) -> None:
    engines = [FakeEngine(script_for([42])), FakeEngine(script_for([42]))]

    async def scenario() -> None:
        async with running_stack(model, engines) as stack:
            for _ in range(4):
                await stack.generate(text_pb2.GenerateRequest(prompt="a"))
        assert [len(e.requests) for e in engines] == [2, 2]

    run(scenario)


# ---- health, Tokenize, Detokenize, ListModels --------------------------------------------


def test_health_is_not_serving_until_the_scheduler_answers(model: ServedModel) -> None:
    engine = FakeEngine(stats_available=False)
    serving = health_pb2.HealthCheckResponse.SERVING
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING

    async def scenario() -> None:
        async with running_stack(model, [engine], warm=False) as stack:
            assert await stack.health_status() == not_serving
            # Before the model is set, requests get UNAVAILABLE, not a crash.
            error = await rpc_error(stack.stub.ListModels(text_pb2.ListModelsRequest()))
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            warm = asyncio.create_task(stack.server.warm_up())
            await asyncio.sleep(0.2)
            assert await stack.health_status() == not_serving
            engine.stats_available = True
            await asyncio.wait_for(warm, TIMEOUT_S)
            assert await stack.health_status() == serving

    run(scenario)


def test_tokenize_detokenize_and_list_models(model: ServedModel) -> None:
    async def scenario() -> None:
        async with running_stack(model) as stack:
            tokens = await stack.stub.Tokenize(text_pb2.TokenizeRequest(text=MIXED_TEXT))
            assert list(tokens.token_ids) == model.tokenizer.encode(MIXED_TEXT)
            assert len(tokens.tokens) == len(tokens.token_ids)
            text = await stack.stub.Detokenize(
                text_pb2.DetokenizeRequest(token_ids=tokens.token_ids)
            )
            assert text.text == MIXED_TEXT

            chat = await stack.stub.Tokenize(
                text_pb2.TokenizeRequest(messages=[text_pb2.ChatMessage(role="user", content="hi")])
            )
            special = await stack.stub.Detokenize(
                text_pb2.DetokenizeRequest(token_ids=chat.token_ids, skip_special_tokens=False)
            )
            assert "<|im_start|>user" in special.text and "hi" in special.text

            bad_role = text_pb2.TokenizeRequest(messages=[text_pb2.ChatMessage(role="x")])
            error = await rpc_error(stack.stub.Tokenize(bad_role))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("messages[0].role:")
            error = await rpc_error(
                stack.stub.Detokenize(text_pb2.DetokenizeRequest(token_ids=[10**7]))
            )
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("token_ids:")

            models = await stack.stub.ListModels(text_pb2.ListModelsRequest())
            (info,) = models.models
            assert info.name == "SmolLM2-135M-Instruct"
            assert info.max_model_len == MAX_MODEL_LEN
            assert info.vocab_size == model.vocab_size

    run(scenario)
