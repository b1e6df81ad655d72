"""The tokenizer tier's servicer over real gRPC on loopback, against a fake Engine servicer
that streams scripted token ids (tests/unit/tokenizer_tier_harness.py): streaming, slow
clients, health, Tokenize, Detokenize and ListModels. Validation, deadlines and errors:
test_tokenizer_server_errors.py."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    MAX_MODEL_LEN,
    TIMEOUT_S,
    FakeEngine,
    Stack,
    joined_ids,
    joined_text,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


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
        from services.text.chat_template import ChatMessage

        expected = model.tokenizer.apply_chat_template(
            [ChatMessage("system", "Be brief."), ChatMessage("user", "Capital of France?")]
        )
        assert list(engine.requests[0].prompt_token_ids) == expected
        assert len(responses[-1].request_id) == 32  # a uuid4 hex when none was given

    run(scenario)


def test_stop_string_across_tokens_is_cut_and_the_scheduler_call_cancelled(
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


def test_slow_client_gets_the_tokens_before_a_scheduler_failure(model: ServedModel) -> None:
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


def test_client_going_away_cancels_the_scheduler_call(model: ServedModel) -> None:
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
