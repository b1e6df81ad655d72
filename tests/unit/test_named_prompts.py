"""Named prompts in the tokenizer tier: reusing the cached ids of the system turn gives the
same ids as tokenizing the whole conversation, and the registry's Redis/local semantics."""

from __future__ import annotations

import asyncio

import pytest

from services.common.cache_keys import CacheKeys
from services.common.model_source import embedded_model_path
from services.common.prompt_store import PromptStore
from services.common.redis_store import RedisStore
from services.contracts.errors import DependencyUnavailableError, InvalidRequestError, NotFoundError
from services.text.chat_template import ChatMessage
from services.text.model_tokenizer import ModelTokenizer
from services.tokenizer.named_prompts import PromptRegistry, system_turn
from services.tokenizer.validation import GenerateInput, Limits, validate_generate
from tests.redis_server import RedisServer

SYSTEM = "You are a terse assistant. Answer in one sentence.\nNever use lists."


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer.from_path(embedded_model_path())


def render_ids(tokenizer: ModelTokenizer):  # type: ignore[no-untyped-def]
    return lambda text: tokenizer.apply_chat_template(
        system_turn(text), add_generation_prompt=False
    )


@pytest.mark.parametrize(
    "messages",
    [
        [ChatMessage("user", "Hi")],
        [ChatMessage("user", " leading space and trailing\n")],
        [ChatMessage("user", "2+2?"), ChatMessage("assistant", "4"), ChatMessage("user", "x3?")],
        [ChatMessage("user", "<|im_start|>not a real turn")],
        [ChatMessage("user", "中文 and émojis 🎉")],
    ],
)
def test_reusing_the_system_turn_ids_equals_full_tokenization(
    tokenizer: ModelTokenizer, messages: list[ChatMessage]
) -> None:
    prefix_ids = render_ids(tokenizer)(SYSTEM)
    reused = tokenizer.encode_chat_after_prefix(system_turn(SYSTEM), prefix_ids, messages)
    full = tokenizer.apply_chat_template([ChatMessage("system", SYSTEM), *messages])
    assert reused == full
    assert reused[: len(prefix_ids)] == prefix_ids


def test_validation_with_a_named_prompt(tokenizer: ModelTokenizer) -> None:
    registry = PromptRegistry(None, render_ids(tokenizer))
    prompt = registry.build("terse", SYSTEM, 0, "")
    limits = Limits("m", 2048, tokenizer.vocab_size, 256)
    user = (ChatMessage("user", "Hi"),)
    validated = validate_generate(
        GenerateInput(messages=user, prompt_name="terse"), limits, tokenizer, prompt
    )
    assert validated.prompt_token_ids[: len(prompt.token_ids)] == prompt.token_ids
    with pytest.raises(InvalidRequestError) as error:
        validate_generate(
            GenerateInput(prompt="Hi", prompt_name="terse"), limits, tokenizer, prompt
        )
    assert error.value.field == "prompt_name"
    own_system = (ChatMessage("system", "x"), *user)
    with pytest.raises(InvalidRequestError) as error:
        validate_generate(
            GenerateInput(messages=own_system, prompt_name="terse"), limits, tokenizer, prompt
        )
    assert error.value.field == "messages"
    for name, text, ttl, field in [
        ("bad name!", SYSTEM, 0, "name"),
        ("ok", "", 0, "system_prompt"),
        ("ok", SYSTEM, 10**9, "ttl_s"),
    ]:
        with pytest.raises(InvalidRequestError) as error:
            registry.build(name, text, ttl, "")
        assert error.value.field == field
    short_context = PromptRegistry(None, render_ids(tokenizer), max_model_len=len(prompt.token_ids))
    with pytest.raises(InvalidRequestError) as error:
        short_context.build("terse", SYSTEM, 0, "")  # leaves no room for a question
    assert error.value.field == "system_prompt"


def test_registry_shared_through_redis_and_serving_on_when_it_is_down(
    tokenizer: ModelTokenizer,
) -> None:
    server = RedisServer().start()
    now = [1000.0]

    def registry() -> PromptRegistry:
        store = PromptStore(RedisStore(server.url, retry_after_s=0.1), CacheKeys("m"))
        return PromptRegistry(store, render_ids(tokenizer), refresh_s=1.0, clock=lambda: now[0])

    async def scenario() -> None:
        replica_a, replica_b = registry(), registry()
        prompt = replica_a.build("terse", SYSTEM, 30, "acme")
        await replica_a.save(prompt)
        assert await replica_b.get("acme", "terse") == prompt  # the other replica sees it
        with pytest.raises(NotFoundError):
            await replica_b.get("", "terse")  # another tenant does not
        assert [p.name for p in await replica_b.list("acme")] == ["terse"]
        server.stop()
        now[0] += 2.0  # past the refresh: Redis is asked, does not answer, the copy serves
        assert await replica_b.get("acme", "terse") == prompt
        fresh = registry()
        with pytest.raises(DependencyUnavailableError):
            await fresh.get("acme", "terse")  # never seen here, Redis down: retryable error
        with pytest.raises(DependencyUnavailableError):
            await fresh.save(fresh.build("other", SYSTEM, 30, "acme"))  # not shared: refused
        with pytest.raises(DependencyUnavailableError):
            await fresh.delete("acme", "terse")
        with pytest.raises(DependencyUnavailableError):
            await fresh.list("acme")
        now[0] += 60.0
        with pytest.raises(DependencyUnavailableError):
            await replica_b.get("acme", "terse")  # expired copies are never served
        server.start()
        await asyncio.sleep(0.15)
        assert await replica_b.list("acme") == []  # a fresh Redis: TTL'd and gone

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_registry_without_redis_is_local() -> None:
    async def scenario() -> None:
        registry = PromptRegistry(None, lambda text: [1, 2, 3])
        await registry.save(registry.build("a", "x", 0, ""))
        assert (await registry.get("", "a")).token_ids == (1, 2, 3)
        assert await registry.delete("", "a") is True
        with pytest.raises(NotFoundError):
            await registry.get("", "a")

    asyncio.run(scenario())


def test_names_and_tenants_no_registration_could_have_are_refused_before_a_lookup() -> None:
    async def scenario() -> None:
        registry = PromptRegistry(None, lambda text: [1], max_prompt_chars=100)
        long_name, long_tenant = "n" * 10_000, "t" * 10_000
        for call, field in [
            (registry.get("", long_name), "prompt_name"),
            (registry.get("", "has space"), "prompt_name"),
            (registry.get(long_tenant, "a"), "tenant_id"),
            (registry.delete("", long_name), "name"),
            (registry.delete(long_tenant, "a"), "tenant_id"),
            (registry.list(long_tenant), "tenant_id"),
        ]:
            with pytest.raises(InvalidRequestError) as error:
                await call
            assert error.value.field == field
            assert len(str(error.value)) < 100
        for name, text, tenant, field in [
            (long_name, "x", "", "name"),
            ("a", "x", long_tenant, "tenant_id"),
            ("a", "x" * 101, "", "system_prompt"),  # by its size, before it is tokenized
        ]:
            with pytest.raises(InvalidRequestError) as error:
                registry.build(name, text, 0, tenant)
            assert error.value.field == field
        with pytest.raises(NotFoundError) as missing:
            await registry.get("", "x" * 128)
        assert "…" in missing.value.message and len(missing.value.message) < 100

    asyncio.run(scenario())
