"""Two scheduler+worker pairs behind the tokenizer tier, with a real Redis the tests control:
cache-aware routing, named prompts across tokenizer replicas, and Redis failures."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest

from protos.llmserve.v1 import scheduler_pb2, scheduler_pb2_grpc, text_pb2, text_pb2_grpc
from services.common.cache_keys import CacheKeys
from services.common.prefix_hash import prefix_block_hashes
from services.common.redis_store import RedisStore
from services.launcher import free_port
from services.stack import RunningStack, running_service, wait_until
from services.tokenizer.routing.prefix_locator import PrefixLocator
from tests.e2e.conftest import e2e_stack
from tests.redis_server import RedisServer

BLOCK = 16
GREEDY = text_pb2.SamplingParams(temperature=0.0, max_new_tokens=8)
SYSTEM = "You are the support assistant of a bakery. Be brief and friendly. " * 12


@dataclass
class RedisStack:
    stack: RunningStack
    redis: RedisServer
    replica_b_address: str

    def stub(self, address: str | None = None) -> text_pb2_grpc.TextGenerationStub:
        return self.stack.text_stub(address)

    def scheduler_stats(self) -> list[scheduler_pb2.SchedulerStats]:
        return [self.stack.stats(address) for address in self.stack.schedulers]

    def indexed_blocks(
        self, prompt_ids: list[int], stats: list[scheduler_pb2.SchedulerStats] | None = None
    ) -> list[int]:
        """Per scheduler, how many leading full blocks of `prompt_ids` the Redis index says it
        holds (under the worker epochs in `stats`, by default the current ones)."""
        holders = [(s.scheduler_id, s.worker_epoch) for s in stats or self.scheduler_stats()]

        async def ask() -> list[int]:
            store = RedisStore(self.redis.url)
            locator = PrefixLocator(store, CacheKeys("SmolLM2-135M-Instruct"))
            found = await locator.cached_blocks(prefix_block_hashes(prompt_ids, BLOCK), holders)
            await store.close()
            return found

        return asyncio.run(ask())

    def wait_until_indexed(self, prompt: str, num_prompt_tokens: int) -> None:
        """Until some scheduler's full blocks of the text prompt are in the index (it is
        written off the step loop, every 50 ms)."""
        ids = list(self.stub().Tokenize(text_pb2.TokenizeRequest(text=prompt)).token_ids)
        assert len(ids) == num_prompt_tokens  # Tokenize gives the ids Generate computed on
        full_blocks = len(prefix_block_hashes(ids, BLOCK))
        wait_until(lambda: max(self.indexed_blocks(ids)) >= full_blocks, 10, "the prefix index")


@pytest.fixture(scope="module")
def redis_stack() -> Iterator[RedisStack]:
    redis = RedisServer().start()
    # int8 weights: these tests compare the stack with itself (cache hit vs miss), so they
    # also show a quantized model serving end to end (ListModels checks the format).
    extra = ["--workers", "2", "--tokenizer-replicas", "1", "--redis-url", redis.url]
    extra += ["--quantization", "int8", "--kv-cache-dtype", "int8"]
    # Redis is stopped however the stack ends, a stack that never came up included.
    try:
        with e2e_stack(extra) as stack:
            # A second tokenizer replica on its own port, so a test can address each replica.
            port = free_port("127.0.0.1")
            replica_args = ["tokenizer", "--port", str(port), "--redis-url", redis.url]
            replica_args += ["--no-http", "--scheduler", ",".join(stack.schedulers)]
            with running_service(replica_args, port, env=stack.child_env) as replica_b:
                yield RedisStack(stack, redis, replica_b.address)
        assert stack.returncode == 0
    finally:
        redis.stop()


def generate(
    stub: text_pb2_grpc.TextGenerationStub, **fields: object
) -> tuple[list[int], text_pb2.Usage]:
    token_ids: list[int] = []
    usage = text_pb2.Usage()
    for response in stub.Generate(
        text_pb2.GenerateRequest(sampling=GREEDY, **fields),  # type: ignore[arg-type]
        timeout=120,
    ):
        token_ids.extend(response.token_ids)
        if response.finish_reason:
            usage = response.usage
    return token_ids, usage


def long_prompt(topic: str) -> str:
    return f"Notes about {topic}. " + " ".join(f"{topic} fact number {i}." for i in range(40))


def test_repeated_prefix_goes_to_the_scheduler_that_holds_it(redis_stack: RedisStack) -> None:
    # Cold through replica B, warm through replica A: A never routed this prefix itself, so
    # only the Redis index can tell it where the prefix is cached.
    stub, stub_b = redis_stack.stub(), redis_stack.stub(redis_stack.replica_b_address)
    for topic in ("rivers", "comets", "violins", "glaciers", "tulips"):
        cold_ids, cold = generate(stub_b, prompt=long_prompt(topic) + " Summary:")
        redis_stack.wait_until_indexed(long_prompt(topic) + " Summary:", cold.prompt_tokens)
        warm_ids, warm = generate(stub, prompt=long_prompt(topic) + " In short:")
        full_blocks = (cold.prompt_tokens - 8) // BLOCK * BLOCK
        # Round-robin would send every second request to the other, cold, scheduler.
        assert warm.cached_prompt_tokens >= full_blocks, topic
        again_ids, again = generate(stub, prompt=long_prompt(topic) + " Summary:")
        assert again_ids == cold_ids and again.cached_prompt_tokens > 0  # same greedy output
    assert len(warm_ids) > 0


def test_list_models_reports_the_quantized_formats(redis_stack: RedisStack) -> None:
    (model,) = redis_stack.stub().ListModels(text_pb2.ListModelsRequest()).models
    assert (model.quantization, model.kv_cache_dtype, model.dtype) == ("int8", "int8", "float32")
    ids, usage = generate(redis_stack.stub(), prompt="The capital of France is")
    assert len(ids) == GREEDY.max_new_tokens and usage.completion_tokens == len(ids)


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"name": "", "token_ids": [1, 2], "ttl_s": 60.0}, "name"),
        ({"name": "p", "token_ids": [], "ttl_s": 60.0}, "token_ids"),
        ({"name": "p", "token_ids": [1, 2], "ttl_s": 0.0}, "ttl_s"),
        ({"name": "p", "token_ids": [10**7], "ttl_s": 60.0}, "token_ids"),
    ],
)
def test_pin_rejects_bad_input_naming_the_field(
    redis_stack: RedisStack,
    fields: dict,  # type: ignore[type-arg]
    field: str,
) -> None:
    address = redis_stack.stack.info["schedulers"][0]
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as error:
        scheduler_pb2_grpc.SchedulerStub(channel).Pin(
            scheduler_pb2.PinRequest(**fields),
            timeout=10,
            metadata=redis_stack.stack.internal_metadata,
        )
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.value.details().startswith(f"{field}:")


def test_named_prompt_is_served_from_cache_by_every_replica(redis_stack: RedisStack) -> None:
    stub_a, stub_b = redis_stack.stub(), redis_stack.stub(redis_stack.replica_b_address)
    registered = stub_a.RegisterPrompt(
        text_pb2.RegisterPromptRequest(name="bakery", system_prompt=SYSTEM, ttl_s=300)
    )
    assert registered.num_pinned_schedulers == 2 and registered.num_tokens > 100
    listed = stub_b.ListPrompts(text_pb2.ListPromptsRequest())
    assert [p.name for p in listed.prompts] == ["bakery"]
    question = [text_pb2.ChatMessage(role="user", content="Do you sell rye bread?")]
    explicit = [text_pb2.ChatMessage(role="system", content=SYSTEM), *question]
    expected_ids, _ = generate(stub_a, messages=explicit)
    pinned_tokens = registered.num_tokens // BLOCK * BLOCK
    for stub in (stub_a, stub_b, stub_b, stub_a):
        ids, usage = generate(stub, messages=question, prompt_name="bakery")
        assert usage.cached_prompt_tokens >= pinned_tokens
        assert ids == expected_ids
    assert all(s.num_pinned_blocks == pinned_tokens // BLOCK for s in redis_stack.scheduler_stats())
    with pytest.raises(grpc.RpcError) as error:
        generate(stub_b, messages=question, prompt_name="bakery", tenant_id="someone-else")
    assert error.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as error:
        stub_b.RegisterPrompt(text_pb2.RegisterPromptRequest(name="no spaces", system_prompt="x"))
    assert (
        error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "name" in error.value.details()
    )
    assert stub_b.DeletePrompt(text_pb2.DeletePromptRequest(name="bakery")).deleted

    def refused_by_a() -> grpc.RpcError | None:
        try:
            generate(stub_a, messages=question, prompt_name="bakery")
        except grpc.RpcError as exc:
            return exc
        return None

    # Replica A's copy is re-read after 1 s.
    refused = wait_until(refused_by_a, 10, "replica A forgetting the prompt", interval_s=0.2)
    assert refused.code() == grpc.StatusCode.NOT_FOUND
    assert all(s.num_pinned_blocks == 0 for s in redis_stack.scheduler_stats())


def test_redis_stopped_mid_run_then_flushed(redis_stack: RedisStack) -> None:
    stub = redis_stack.stub()
    prompt = long_prompt("lighthouses")
    reference, _ = generate(stub, prompt=prompt)
    in_flight = stub.Generate(
        text_pb2.GenerateRequest(
            prompt=prompt, sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=24)
        ),
        timeout=120,
    )
    first = next(in_flight)
    redis_stack.redis.stop()
    rest = list(in_flight)
    assert rest[-1].finish_reason == "length" and len(first.token_ids) > 0
    for _ in range(3):  # Redis is gone: misses, never errors
        ids, _ = generate(stub, prompt=prompt)
        assert ids == reference
    redis_stack.redis.start()  # back, empty (as after a flush): serving never stopped
    ids, _ = generate(stub, prompt=prompt)
    assert ids == reference
    redis_stack.redis.command("FLUSHALL")
    stub_b = redis_stack.stub(redis_stack.replica_b_address)
    for topic in ("harbours", "islands", "canals"):  # B computes, A must find it via Redis
        _, cold = generate(stub_b, prompt=long_prompt(topic))
        redis_stack.wait_until_indexed(long_prompt(topic), cold.prompt_tokens)
        _, usage = generate(stub, prompt=long_prompt(topic) + " Again.")
        assert usage.cached_prompt_tokens > 0, topic  # the index works again after recovery
    assert generate(stub, prompt=prompt)[0] == reference


def test_restarted_worker_stale_entries_are_not_trusted(redis_stack: RedisStack) -> None:
    stub = redis_stack.stub()
    tokenize = stub.Tokenize(text_pb2.TokenizeRequest(text=long_prompt("orchards")))
    prompt_ids = list(tokenize.token_ids)
    generate(stub, prompt_token_ids=prompt_ids)
    before = redis_stack.scheduler_stats()
    num_blocks = len(prefix_block_hashes(prompt_ids, BLOCK))

    def lookup(stats: list[scheduler_pb2.SchedulerStats]) -> list[int]:
        return redis_stack.indexed_blocks(prompt_ids, stats)

    # The index is written off the step loop: wait until it holds every block.
    wait_until(lambda: max(lookup(before)) == num_blocks, 10, "the prefix index", interval_s=0.1)
    holders = [i for i, count in enumerate(lookup(before)) if count > 0]
    assert len(holders) == 1
    holder = holders[0]
    os.kill(redis_stack.stack.info["pids"][f"worker-{holder}"], signal.SIGKILL)

    def new_epoch() -> list[scheduler_pb2.SchedulerStats] | None:
        try:
            stats = redis_stack.scheduler_stats()
        except grpc.RpcError:
            return None
        epoch = stats[holder].worker_epoch
        return stats if epoch not in ("", before[holder].worker_epoch) else None

    after = wait_until(new_epoch, 180, "the worker coming back", interval_s=0.5)
    # The entries written before the restart are still in Redis, under the old epoch...
    assert lookup(before)[holder] == num_blocks
    # ...and with the new epoch they count for nothing.
    assert lookup(after)[holder] == 0

    def served() -> tuple[list[int], text_pb2.Usage] | None:
        try:
            return generate(stub, prompt_token_ids=prompt_ids)
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            return None

    # The tokenizer serves again once its scheduler has a worker.
    ids, usage = wait_until(served, 60, "serving after the restart", interval_s=0.5)
    assert usage.completion_tokens == len(ids) == GREEDY.max_new_tokens
