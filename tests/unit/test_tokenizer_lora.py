"""LoRA adapters through the tokenizer tier, over real gRPC on loopback with fake schedulers that
hold adapters: `model` naming an adapter reaches Submit as lora_name and is echoed; an unknown
name is a 404 / NOT_FOUND naming it (after one more read of the stats); the official `openai`
client lists adapters with their parent; load and unload are for admin keys, go to every
scheduler and merge their answers; routing prefers a scheduler where the adapter is active and
hashes the prompt under the adapter's salt. The merging of answers is also tested alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from openai import OpenAI

from protos.llmserve.v1 import lora_pb2, scheduler_pb2, text_pb2
from services.common.prefix_hash import BlockHash, adapter_salt, prefix_block_hashes, tenant_salt
from services.contracts.errors import (
    NotFoundError,
)
from services.tokenizer.routing.pool import SchedulerClient, SchedulerPool
from services.tokenizer.routing.scheduler_snapshot import SchedulerSnapshot
from services.tokenizer.server import ServedModel
from tests.unit.tokenizer_tier_harness import (
    TIMEOUT_S,
    FakeEngine,
    Stack,
    rpc_error,
    run,
    running_stack,
    script_for,
    served_model,
)

BASE = "SmolLM2-135M-Instruct"
USER_KEY = "sk-user-0123456789"
ADMIN_KEY = "sk-admin-0123456789"
KEYS: dict[str, Any] = {"api_key": (USER_KEY,), "admin_api_key": (ADMIN_KEY,)}
SLOW_POLL: dict[str, Any] = {"stats_poll_s": 3600.0}
"""Stats read at start and never again by the poller: what changes after is seen only by the
reads the tier makes on purpose (an unknown name, a load or an unload through it)."""


async def after_the_first_poll() -> None:
    """The poller reads the stats once as it starts (right after warm-up), then sleeps."""
    await asyncio.sleep(0.3)


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return served_model()


@dataclass
class LoraEngine(FakeEngine):
    """A scheduler whose worker holds LoRA adapters: listed in its stats, refused at Submit
    when not held (NOT_FOUND, as the scheduler does), loaded and unloaded by its calls."""

    scheduler_id: str = "fake"
    adapters: dict[str, str] = field(default_factory=dict)
    """name -> path"""
    active: set[str] = field(default_factory=set)
    refuse_load: tuple[grpc.StatusCode, str] | None = None
    calls: list[str] = field(default_factory=list)

    async def Submit(
        self, request: scheduler_pb2.SubmitRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.SubmitResponse]:
        if request.lora_name and request.lora_name not in self.adapters:
            self.requests.append(request)
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"lora_name: no LoRA adapter {request.lora_name!r} is loaded on this worker",
            )
        async for response in super().Submit(request, context):
            yield response

    async def GetStats(
        self, request: scheduler_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.SchedulerStats:
        return scheduler_pb2.SchedulerStats(
            scheduler_id=self.scheduler_id,
            num_free_blocks=100,
            block_size=16,
            lora_adapters=sorted(self.adapters),
            active_lora_adapters=sorted(self.active),
            max_loras=2,
        )

    async def LoadLoraAdapter(
        self, request: lora_pb2.LoadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.LoraAdapterInfo:
        self.calls.append(f"load {request.name} {request.path}")
        if self.refuse_load is not None:
            await context.abort(*self.refuse_load)
        if request.name in self.adapters:
            await context.abort(
                grpc.StatusCode.ALREADY_EXISTS, f"name: adapter {request.name!r} is loaded"
            )
        self.adapters[request.name] = request.path
        return self._info(request.name)

    async def UnloadLoraAdapter(
        self, request: lora_pb2.UnloadLoraAdapterRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.UnloadLoraAdapterResponse:
        self.calls.append(f"unload {request.name}")
        if request.name not in self.adapters:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"name: no adapter {request.name!r}")
        del self.adapters[request.name]
        self.active.discard(request.name)
        return lora_pb2.UnloadLoraAdapterResponse()

    async def ListLoraAdapters(
        self, request: lora_pb2.ListLoraAdaptersRequest, context: grpc.aio.ServicerContext
    ) -> lora_pb2.ListLoraAdaptersResponse:
        return lora_pb2.ListLoraAdaptersResponse(
            adapters=[self._info(name) for name in sorted(self.adapters)]
        )

    def _info(self, name: str) -> lora_pb2.LoraAdapterInfo:
        return lora_pb2.LoraAdapterInfo(
            name=name,
            path=self.adapters[name],
            rank=8,
            targets=["q_proj", "v_proj"],
            scaling=2.0,
            load_ms=3.0,
            slot=0 if name in self.active else -1,
            num_running=1 if name in self.active else 0,
        )


def engine(model: ServedModel, **fields: Any) -> LoraEngine:
    ids = model.tokenizer.encode(" SELECT 1;", add_special_tokens=False)
    return LoraEngine(script_for(ids, finish_reason="stop"), **fields)


def http_url(stack: Stack) -> str:
    assert stack.server.http is not None
    return f"http://127.0.0.1:{stack.server.http.port}"


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def grpc_key(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


# ---- naming an adapter in a request ------------------------------------------------------


def test_a_request_naming_an_adapter_runs_with_it(model: ServedModel) -> None:
    scheduler = engine(model, adapters={"sql": "/adapters/sql"})

    async def scenario() -> None:
        async with running_stack(model, [scheduler]) as stack:
            await stack.generate(text_pb2.GenerateRequest(prompt="q", model="sql"))
            await stack.generate(text_pb2.GenerateRequest(prompt="q", model=BASE))
            await stack.generate(text_pb2.GenerateRequest(prompt="q"))
            async with httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http:
                response = await http.post(
                    "/v1/completions", json={"model": "sql", "prompt": "q", "max_tokens": 4}
                )
                message = await http.post(
                    "/v1/messages",
                    json={
                        "model": "sql",
                        "max_tokens": 4,
                        "messages": [{"role": "user", "content": "q"}],
                    },
                )
        assert response.status_code == 200, response.text
        assert response.json()["model"] == "sql"
        assert message.status_code == 200, message.text
        assert message.json()["model"] == "sql"
        assert [r.lora_name for r in scheduler.requests] == ["sql", "", "", "sql", "sql"]
        # The scheduler salts the cache itself: the tenant's salt goes as it is.
        assert {r.cache_salt for r in scheduler.requests} == {b""}

    run(scenario)


def test_an_unknown_model_is_a_404_naming_it_and_never_reaches_a_scheduler(
    model: ServedModel,
) -> None:
    scheduler = engine(model, adapters={"sql": "/adapters/sql"})

    async def scenario() -> None:
        async with running_stack(model, [scheduler]) as stack:
            error = await rpc_error(
                stack.generate(text_pb2.GenerateRequest(prompt="q", model="sq"))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("model: unknown model 'sq'")
            async with httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http:
                body = {"model": "sq", "messages": [{"role": "user", "content": "q"}]}
                response = await http.post("/v1/chat/completions", json=body)
        assert response.status_code == 404
        error_body = response.json()["error"]
        assert (error_body["code"], error_body["param"], error_body["type"]) == (
            "model_not_found",
            "model",
            "not_found_error",
        )
        assert "'sq'" in error_body["message"]
        assert scheduler.requests == []

    run(scenario)


def test_an_adapter_loaded_elsewhere_is_found_by_reading_the_stats_again(
    model: ServedModel,
) -> None:
    scheduler = engine(model)

    async def scenario() -> None:
        async with running_stack(model, [scheduler], **SLOW_POLL) as stack:
            await after_the_first_poll()
            # Loaded through another replica: this one's stats do not list it yet.
            scheduler.adapters["late"] = "/adapters/late"
            await stack.generate(text_pb2.GenerateRequest(prompt="q", model="late"))
        assert [r.lora_name for r in scheduler.requests] == ["late"]

    run(scenario)


def test_the_schedulers_not_found_at_submit_is_the_same_404(model: ServedModel) -> None:
    scheduler = engine(model, adapters={"sql": "/adapters/sql"})

    async def scenario() -> None:
        async with running_stack(model, [scheduler], **SLOW_POLL) as stack:
            await after_the_first_poll()
            # Unloaded through another replica: this one's stats still list it.
            del scheduler.adapters["sql"]
            error = await rpc_error(
                stack.generate(text_pb2.GenerateRequest(prompt="q", model="sql"))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("model: no LoRA adapter 'sql'")
            async with httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http:
                response = await http.post("/v1/completions", json={"model": "sql", "prompt": "q"})
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "model_not_found"
        assert response.json()["error"]["param"] == "model"

    run(scenario)


def test_the_openai_client_uses_and_lists_adapters(model: ServedModel) -> None:
    scheduler = engine(model, adapters={"sql": "/adapters/sql", "fr": "/adapters/fr"})

    def with_client(url: str) -> tuple[str, str, list[tuple[str, Any]]]:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        answer = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "all users"}]
        )
        chunks = client.chat.completions.create(
            model="sql", messages=[{"role": "user", "content": "all users"}], stream=True
        )
        streamed = {chunk.model for chunk in chunks}
        assert streamed == {"sql"}
        content = answer.choices[0].message.content or ""
        listed = [(m.id, getattr(m, "parent", "absent")) for m in client.models.list()]
        return answer.model, content, listed

    async def scenario() -> None:
        async with running_stack(model, [scheduler]) as stack:
            name, content, listed = await asyncio.to_thread(with_client, http_url(stack))
        assert name == "sql"
        assert content == " SELECT 1;"
        assert listed == [(BASE, None), ("fr", BASE), ("sql", BASE)]
        assert [r.lora_name for r in scheduler.requests] == ["sql", "sql"]

    run(scenario)


def test_list_models_over_grpc_names_each_adapters_parent(model: ServedModel) -> None:
    schedulers = [
        engine(model, scheduler_id="a", adapters={"sql": "/a/sql"}),
        engine(model, scheduler_id="b", adapters={"fr": "/b/fr", "sql": "/b/sql"}),
    ]

    async def scenario() -> None:
        async with running_stack(model, schedulers) as stack:
            await after_the_first_poll()  # warm-up read the first scheduler's stats only
            models = await stack.stub.ListModels(text_pb2.ListModelsRequest())
        assert [(m.name, m.parent) for m in models.models] == [
            (BASE, ""),
            ("fr", BASE),
            ("sql", BASE),
        ]
        assert {m.max_model_len for m in models.models} == {model.max_model_len}

    run(scenario)


# ---- routing ------------------------------------------------------------------------------


def test_requests_go_where_the_adapter_is_held_and_active(model: ServedModel) -> None:
    loaded = engine(model, scheduler_id="loaded", adapters={"sql": "/s", "fr": "/f"})
    active = engine(model, scheduler_id="active", adapters={"sql": "/s"}, active={"sql"})

    async def scenario() -> None:
        async with running_stack(model, [loaded, active], routing="least_loaded") as stack:
            await after_the_first_poll()
            for prompt in ("a", "b", "c"):
                await stack.generate(text_pb2.GenerateRequest(prompt=prompt, model="sql"))
            await stack.generate(text_pb2.GenerateRequest(prompt="d", model="fr"))
        assert [r.lora_name for r in active.requests] == ["sql", "sql", "sql"]
        assert [r.lora_name for r in loaded.requests] == ["fr"]

    run(scenario)


@dataclass
class RecordingLocator:
    """The prefix index, as `pick` asks it: which hashes."""

    asked: list[list[BlockHash]] = field(default_factory=list)

    async def cached_blocks(
        self, hashes: Sequence[BlockHash], schedulers: Sequence[tuple[str, str]]
    ) -> list[int]:
        self.asked.append(list(hashes))
        return [0] * len(schedulers)


def snapshot(
    scheduler_id: str, adapters: set[str], active: frozenset[str] = frozenset()
) -> SchedulerSnapshot:
    return SchedulerSnapshot(
        scheduler_id, "epoch", 16, 0, 0, 100, "float32", "auto", "", frozenset(adapters),
        active, 2,
    )  # fmt: skip


def test_pick_hashes_the_prompt_under_the_adapters_salt_and_skips_non_holders() -> None:
    async def scenario() -> None:
        locator = RecordingLocator()
        pool = SchedulerPool([], locator=locator)  # type: ignore[arg-type]
        holder = SchedulerClient("a:1", None, None, snapshot("a", {"sql"}))  # type: ignore[arg-type]
        other = SchedulerClient("b:1", None, None, snapshot("b", set()))  # type: ignore[arg-type]
        pool.routable = [other, holder]
        prompt = list(range(40))
        salt = tenant_salt("acme")
        assert await pool.pick(prompt, salt, "sql") is holder
        assert locator.asked[-1] == prefix_block_hashes(prompt, 16, adapter_salt(salt, "sql"))
        await pool.pick(prompt, salt)
        assert locator.asked[-1] == prefix_block_hashes(prompt, 16, salt)
        with pytest.raises(NotFoundError) as info:
            await pool.pick(prompt, salt, "fr")
        assert info.value.field == "model" and "'fr'" in info.value.message

    asyncio.run(scenario())


# ---- load and unload ----------------------------------------------------------------------


def test_load_and_unload_over_http_reach_every_scheduler_and_hold_at_once(
    model: ServedModel,
) -> None:
    schedulers = [engine(model, scheduler_id="a"), engine(model, scheduler_id="b")]

    async def scenario() -> None:
        async with (
            running_stack(model, schedulers, **KEYS, **SLOW_POLL) as stack,
            httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http,
        ):
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            refused = await http.post("/v1/load_lora_adapter", json=body, headers=bearer(USER_KEY))
            assert refused.status_code == 403, refused.text
            assert refused.json()["error"]["type"] == "permission_error"
            assert all(s.calls == [] for s in schedulers)

            loaded = await http.post("/v1/load_lora_adapter", json=body, headers=bearer(ADMIN_KEY))
            assert loaded.status_code == 200, loaded.text
            assert loaded.json() == {
                "object": "lora_adapter",
                "name": "sql",
                "path": "/adapters/sql",
                "parent": BASE,
                "num_loaded_schedulers": 2,
            }
            assert all(s.adapters == {"sql": "/adapters/sql"} for s in schedulers)
            # Usable through this replica at once (its poller would take an hour).
            models = await http.get("/v1/models", headers=bearer(USER_KEY))
            assert [m["id"] for m in models.json()["data"]] == [BASE, "sql"]
            answer = await http.post(
                "/v1/completions",
                json={"model": "sql", "prompt": "q"},
                headers=bearer(USER_KEY),
            )
            assert answer.status_code == 200, answer.text

            again = await http.post("/v1/load_lora_adapter", json=body, headers=bearer(ADMIN_KEY))
            assert again.status_code == 409
            assert again.json()["error"]["code"] == "already_exists"
            assert "'sql' is loaded already" in again.json()["error"]["message"]

            unload = {"lora_name": "sql"}
            refused = await http.post(
                "/v1/unload_lora_adapter", json=unload, headers=bearer(USER_KEY)
            )
            assert refused.status_code == 403
            unloaded = await http.post(
                "/v1/unload_lora_adapter", json=unload, headers=bearer(ADMIN_KEY)
            )
            assert unloaded.status_code == 200, unloaded.text
            assert unloaded.json() == {
                "object": "lora_adapter",
                "name": "sql",
                "deleted": True,
                "num_unloaded_schedulers": 2,
            }
            models = await http.get("/v1/models", headers=bearer(USER_KEY))
            assert [m["id"] for m in models.json()["data"]] == [BASE]
            gone = await http.post(
                "/v1/completions", json={"model": "sql", "prompt": "q"}, headers=bearer(USER_KEY)
            )
            assert gone.status_code == 404
            unknown = await http.post(
                "/v1/unload_lora_adapter", json=unload, headers=bearer(ADMIN_KEY)
            )
            assert unknown.status_code == 404
            assert unknown.json()["error"]["param"] == "lora_name"

    run(scenario)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"lora_name": "sql"}, "lora_path"),
        ({"lora_name": "sql", "lora_path": ""}, "lora_path"),
        ({"lora_name": "", "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "s" * 129, "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "s\n", "lora_path": "/a"}, "lora_name"),
        ({"lora_name": BASE, "lora_path": "/a"}, "lora_name"),
        ({"lora_name": 7, "lora_path": "/a"}, "lora_name"),
        ({"lora_name": "sql", "lora_path": "/a", "load_inplace": True}, "load_inplace"),
    ],
)
def test_a_bad_load_body_is_a_400_naming_the_parameter(
    model: ServedModel, body: dict[str, Any], param: str
) -> None:
    scheduler = engine(model)

    async def scenario() -> None:
        async with (
            running_stack(model, [scheduler]) as stack,
            httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http,
        ):
            response = await http.post("/v1/load_lora_adapter", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param
        assert scheduler.calls == []

    run(scenario)


def test_load_errors_name_the_field_and_the_schedulers_that_refused(model: ServedModel) -> None:
    misfit = (grpc.StatusCode.INVALID_ARGUMENT, "r: rank 64 is over this worker's max_lora_rank 16")
    fits = engine(model, scheduler_id="fits")
    small = engine(model, scheduler_id="small", refuse_load=misfit)

    async def scenario() -> None:
        async with (
            running_stack(model, [fits, small]) as stack,
            httpx.AsyncClient(base_url=http_url(stack), timeout=TIMEOUT_S) as http,
        ):
            body = {"lora_name": "sql", "lora_path": "/adapters/sql"}
            response = await http.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert error["param"] == "r"
            assert error["message"].startswith("r: rank 64 is over")
            small_address = stack.server.pool.addresses[1]
            assert f"refused by {small_address}; loaded on 1 of 2 schedulers" in error["message"]

            # Every scheduler refusing alike: that refusal, as it is.
            fits.refuse_load = small.refuse_load = (
                grpc.StatusCode.INVALID_ARGUMENT,
                "path: /adapters/fr is neither a PEFT directory nor a .gguf file",
            )
            body = {"lora_name": "fr", "lora_path": "/adapters/fr"}
            response = await http.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 400
            assert response.json()["error"]["param"] == "lora_path"
            assert response.json()["error"]["message"] == (
                "lora_path: /adapters/fr is neither a PEFT directory nor a .gguf file"
            )

            # Fixed, loaded again: the scheduler holding it already counts as holding it.
            fits.refuse_load = small.refuse_load = None
            response = await http.post(
                "/v1/load_lora_adapter", json={"lora_name": "sql", "lora_path": "/adapters/sql"}
            )
            assert response.status_code == 200, response.text
            assert response.json()["num_loaded_schedulers"] == 2

    run(scenario)


def test_grpc_load_unload_and_list_are_for_admins_and_merge_the_pool(model: ServedModel) -> None:
    schedulers = [engine(model, scheduler_id="a"), engine(model, scheduler_id="b")]

    async def scenario() -> None:
        async with running_stack(model, schedulers, **KEYS) as stack:
            request = lora_pb2.LoadLoraAdapterRequest(name="sql", path="/adapters/sql")
            error = await rpc_error(
                stack.stub.LoadLoraAdapter(request, metadata=grpc_key(USER_KEY))
            )
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            info = await stack.stub.LoadLoraAdapter(request, metadata=grpc_key(ADMIN_KEY))
            assert (info.name, info.path, info.parent, info.num_loaded_schedulers) == (
                "sql",
                "/adapters/sql",
                BASE,
                2,
            )
            assert (info.rank, list(info.targets), info.slot) == (8, ["q_proj", "v_proj"], -1)
            error = await rpc_error(
                stack.stub.LoadLoraAdapter(request, metadata=grpc_key(ADMIN_KEY))
            )
            assert error.code() == grpc.StatusCode.ALREADY_EXISTS
            assert error.details().startswith("LoRA adapter 'sql' is loaded already")

            base = lora_pb2.LoadLoraAdapterRequest(name=BASE, path="/a")
            error = await rpc_error(stack.stub.LoadLoraAdapter(base, metadata=grpc_key(ADMIN_KEY)))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error.details().startswith("name: ")

            schedulers[1].active.add("sql")
            listed = await stack.stub.ListLoraAdapters(
                lora_pb2.ListLoraAdaptersRequest(), metadata=grpc_key(USER_KEY)
            )
            assert [(a.name, a.num_loaded_schedulers, a.num_running, a.parent, a.slot)
                    for a in listed.adapters] == [("sql", 2, 1, BASE, -1)]  # fmt: skip

            unload = lora_pb2.UnloadLoraAdapterRequest(name="sql")
            error = await rpc_error(
                stack.stub.UnloadLoraAdapter(unload, metadata=grpc_key(USER_KEY))
            )
            assert error.code() == grpc.StatusCode.PERMISSION_DENIED
            answer = await stack.stub.UnloadLoraAdapter(unload, metadata=grpc_key(ADMIN_KEY))
            assert answer.num_unloaded_schedulers == 2
            error = await rpc_error(
                stack.stub.UnloadLoraAdapter(unload, metadata=grpc_key(ADMIN_KEY))
            )
            assert error.code() == grpc.StatusCode.NOT_FOUND
            assert error.details().startswith("name: no LoRA adapter 'sql' is loaded")
        assert schedulers[0].calls == ["load sql /adapters/sql", "load sql /adapters/sql",
                                       "unload sql", "unload sql"]  # fmt: skip

    run(scenario)
