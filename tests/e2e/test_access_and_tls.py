"""Access control and TLS on a real stack: API keys (plain, tenant-bound, admin) on both public
doors, TLS on both ports with a certificate made here, and a full queue answered with 429."""

from __future__ import annotations

import asyncio
import ssl
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.client import auth_metadata, public_channel
from services.stack import RunningStack, running_stack
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S
from tests.tls_certs import self_signed

pytestmark = pytest.mark.slow

USER_KEY = "sk-user-0f3a9c1e"  # from --api-key: no tenant, names its own
ADMIN_KEY = "sk-admin-77b2d4"
TENANT_A_KEY = "sk-tenant-a-5e1f"
TENANT_B_KEY = "sk-tenant-b-c0de"
FILE_KEY = "sk-file-user-9a9a"
KEYS = (USER_KEY, ADMIN_KEY, TENANT_A_KEY, TENANT_B_KEY, FILE_KEY)


@dataclass
class SecureStack:
    stack: RunningStack
    cert: Path
    log: Path

    def channel(self) -> grpc.Channel:
        return public_channel(self.stack.public, tls_ca=str(self.cert))

    def stub(self) -> text_pb2_grpc.TextGenerationStub:
        return text_pb2_grpc.TextGenerationStub(self.channel())

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.cert))

    def openai(self, key: str) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=self.stack.http,
            api_key=key,
            max_retries=0,
            timeout=120,
            http_client=httpx.Client(verify=self.ssl_context()),
        )

    def post(self, path: str, body: dict[str, object], key: str | None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.post(
            f"{self.stack.http}{path}",
            json=body,
            headers=headers,
            verify=self.ssl_context(),
            timeout=60,
        )


@pytest.fixture(scope="module")
def secure() -> Iterator[SecureStack]:
    with tempfile.TemporaryDirectory(prefix="llmserve-tls-") as name:
        directory = Path(name)
        cert, key = self_signed(directory)
        key_file = directory / "keys.txt"
        key_file.write_text(
            "# test keys\n"
            f"{TENANT_A_KEY} tenant=tenant-a\n"
            f"{TENANT_B_KEY} tenant=tenant-b   # a comment\n"
            "\n"
            f"{FILE_KEY}\n"
        )
        log = directory / "stack.log"
        flags = [
            *STACK_FLAGS,
            *("--api-key", USER_KEY, "--admin-api-key", ADMIN_KEY),
            *("--api-key-file", str(key_file)),
            *("--tls-cert", str(cert), "--tls-key", str(key)),
            # A small queue, so a burst meets a full one (429).
            *("--max-num-seqs", "1", "--max-waiting-requests", "1"),
        ]
        with (
            log.open("wb") as stderr,
            running_stack(flags, startup_timeout_s=STARTUP_TIMEOUT_S, stderr=stderr) as stack,
        ):
            yield SecureStack(stack, cert, log)
        assert stack.returncode == 0


def model_name(secure: SecureStack) -> str:
    return secure.openai(USER_KEY).models.list().data[0].id


# ---- keys -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "status"),
    [(None, 401), ("sk-wrong", 401), (USER_KEY, 200), (FILE_KEY, 200), (ADMIN_KEY, 200)],
)
def test_http_needs_a_known_key(secure: SecureStack, key: str | None, status: int) -> None:
    body = {"model": model_name(secure), "prompt": "Hi", "max_tokens": 2}
    response = secure.post("/completions", body, key)
    assert response.status_code == status, response.text
    if status == 401:
        error = response.json()["error"]
        assert error["type"] == "authentication_error"
        assert response.headers["www-authenticate"] == "Bearer"
        assert "sk-wrong" not in response.text


def test_the_openai_client_sees_401_for_a_wrong_key(secure: SecureStack) -> None:
    with pytest.raises(openai.AuthenticationError):
        secure.openai("sk-wrong").models.list()


def test_health_and_reflection_stay_open(secure: SecureStack) -> None:
    base = secure.stack.http.removesuffix("/v1")
    context = secure.ssl_context()
    assert httpx.get(f"{base}/health", verify=context, timeout=10).status_code == 200
    assert httpx.get(f"{base}/ready", verify=context, timeout=10).status_code == 200
    health = health_pb2_grpc.HealthStub(secure.channel())
    answer = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert answer.status == health_pb2.HealthCheckResponse.SERVING


def generate_ids(
    stub: text_pb2_grpc.TextGenerationStub, key: str | None, **fields: object
) -> list[int]:
    request = text_pb2.GenerateRequest(**fields)  # type: ignore[arg-type]
    request.sampling.max_new_tokens = 3
    request.sampling.temperature = 0
    responses = stub.Generate(request, timeout=60, metadata=auth_metadata(key))
    return [t for r in responses for t in r.token_ids]


def rpc_code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        if callable(call):
            call()
    return info.value.code()  # type: ignore[attr-defined,no-any-return]


def test_grpc_needs_a_known_key(secure: SecureStack) -> None:
    stub = secure.stub()
    assert rpc_code(lambda: generate_ids(stub, None, prompt="Hi")) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert rpc_code(lambda: generate_ids(stub, "sk-wrong", prompt="Hi")) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    assert len(generate_ids(stub, USER_KEY, prompt="Hi")) == 3
    assert (
        rpc_code(lambda: stub.ListModels(text_pb2.ListModelsRequest(), timeout=10))
        == grpc.StatusCode.UNAUTHENTICATED
    )


def test_named_prompts_need_an_admin_key_and_stay_with_their_tenant(secure: SecureStack) -> None:
    stub = secure.stub()
    register = text_pb2.RegisterPromptRequest(
        name="support", system_prompt="You are the support bot of tenant A.", tenant_id="tenant-a"
    )
    for key in (USER_KEY, TENANT_A_KEY):
        assert (
            rpc_code(
                lambda key=key: stub.RegisterPrompt(
                    register, timeout=60, metadata=auth_metadata(key)
                )
            )
            == grpc.StatusCode.PERMISSION_DENIED
        )
    registered = stub.RegisterPrompt(register, timeout=120, metadata=auth_metadata(ADMIN_KEY))
    assert registered.tenant_id == "tenant-a"

    def listed(key: str, tenant_id: str = "") -> list[str]:
        request = text_pb2.ListPromptsRequest(tenant_id=tenant_id)
        answer = stub.ListPrompts(request, timeout=10, metadata=auth_metadata(key))
        return [p.name for p in answer.prompts]

    # Tenant A's key sees its prompt without naming the tenant; B's key sees none, and may not
    # name A.
    assert listed(TENANT_A_KEY) == ["support"]
    assert listed(TENANT_B_KEY) == []
    assert rpc_code(lambda: listed(TENANT_B_KEY, "tenant-a")) == grpc.StatusCode.PERMISSION_DENIED

    # Using it: A's key may, B's key gets not-found (its tenant has no such prompt) or denied.
    message = text_pb2.ChatMessage(role="user", content="Hello")
    assert len(generate_ids(stub, TENANT_A_KEY, messages=[message], prompt_name="support")) == 3
    assert (
        rpc_code(
            lambda: generate_ids(stub, TENANT_B_KEY, messages=[message], prompt_name="support")
        )
        == grpc.StatusCode.NOT_FOUND
    )
    assert (
        rpc_code(
            lambda: generate_ids(
                stub, TENANT_B_KEY, messages=[message], prompt_name="support", tenant_id="tenant-a"
            )
        )
        == grpc.StatusCode.PERMISSION_DENIED
    )

    # The same over HTTP.
    body = {
        "model": model_name(secure),
        "messages": [{"role": "user", "content": "Hello"}],
        "prompt_name": "support",
        "max_tokens": 3,
    }
    assert secure.post("/chat/completions", body, TENANT_A_KEY).status_code == 200
    assert secure.post("/chat/completions", body, TENANT_B_KEY).status_code == 404
    denied = secure.post("/chat/completions", {**body, "tenant_id": "tenant-a"}, TENANT_B_KEY)
    assert denied.status_code == 403
    assert denied.json()["error"]["type"] == "permission_error"

    delete = text_pb2.DeletePromptRequest(name="support", tenant_id="tenant-a")
    assert (
        rpc_code(
            lambda: stub.DeletePrompt(delete, timeout=10, metadata=auth_metadata(TENANT_A_KEY))
        )
        == grpc.StatusCode.PERMISSION_DENIED
    )
    assert stub.DeletePrompt(delete, timeout=10, metadata=auth_metadata(ADMIN_KEY)).deleted


# ---- TLS ----------------------------------------------------------------------------------------


def test_tls_is_required_on_both_ports(secure: SecureStack) -> None:
    # Plaintext gRPC to a TLS port fails; so does HTTPS with a client that does not trust
    # the certificate.
    with grpc.insecure_channel(secure.stack.public) as channel:
        stub = text_pb2_grpc.TextGenerationStub(channel)
        assert (
            rpc_code(
                lambda: list(
                    stub.Generate(
                        text_pb2.GenerateRequest(prompt="Hi"),
                        timeout=10,
                        metadata=auth_metadata(USER_KEY),
                    )
                )
            )
            == grpc.StatusCode.UNAVAILABLE
        )
    assert secure.stack.http.startswith("https://")
    with pytest.raises(httpx.ConnectError):
        httpx.get(secure.stack.http.removesuffix("/v1") + "/health", timeout=10)
    plain = secure.stack.http.replace("https://", "http://").removesuffix("/v1") + "/health"
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain, timeout=10)


def test_the_openai_client_over_tls(secure: SecureStack) -> None:
    answer = secure.openai(USER_KEY).chat.completions.create(
        model=model_name(secure),
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=4,
        temperature=0,
    )
    assert answer.choices[0].message.content


# ---- a full queue -------------------------------------------------------------------------------


def test_a_full_queue_is_429_with_retry_after_and_frees_everything(secure: SecureStack) -> None:
    body = {
        "model": model_name(secure),
        "prompt": "Count:",
        "max_tokens": 64,
        "ignore_eos": True,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {USER_KEY}"}

    async def one(http: httpx.AsyncClient) -> tuple[int, str | None]:
        async with http.stream(
            "POST", f"{secure.stack.http}/completions", json=body, headers=headers
        ) as response:
            await response.aread()
            return response.status_code, response.headers.get("retry-after")

    async def burst() -> list[tuple[int, str | None]]:
        async with httpx.AsyncClient(verify=secure.ssl_context(), timeout=120) as http:
            return await asyncio.gather(*(one(http) for _ in range(6)))

    results = asyncio.run(burst())
    statuses = [status for status, _ in results]
    # One running and one waiting fit; the rest of a simultaneous burst cannot.
    assert statuses.count(200) >= 2, statuses
    assert 429 in statuses, statuses
    # Retry-After is the scheduler's hint in whole seconds: at least 1, at most its 10 s cap.
    assert all(retry and 1 <= int(retry) <= 10 for status, retry in results if status == 429)
    stats = secure.stack.wait_all_blocks_free(timeout_s=10)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_keys_never_reach_the_logs(secure: SecureStack) -> None:
    # Runs last in this module: every key has been used, right and wrong, by then.
    text = secure.log.read_text(errors="replace")
    assert "tokenizer" in text  # the log is the stack's
    for key in KEYS:
        assert key not in text
