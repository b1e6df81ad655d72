"""The stack's internal ports trust only the stack, on a real `llmserve up`: the Engine and
Worker APIs need the stack's secret, the worker takes one controller (a second Step stream is
refused while a request runs on, a hung or restarted scheduler gets its worker back), the
private Redis needs its password, and no secret shows in a log or a command line."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import pytest
import redis

from protos.llmserve.v1 import (
    model_pb2,
    sampling_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    text_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.internal_auth import INTERNAL_SECRET_KEY
from services.common.prefix_hash import tenant_salt
from services.common.sampling_proto import sampling_to_proto
from services.contracts.sampling_params import SamplingParams
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.stack import RunningStack, running_stack, wait_until
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S

pytestmark = pytest.mark.slow

WRONG_SECRET = "not-the-stack-secret-5d1e"
PROMPT = "The history of paper begins"
LONG_PROMPT = "Notes about rivers. " + " ".join(f"River fact number {i}." for i in range(30))


@dataclass
class TrustStack:
    stack: RunningStack
    log: Path

    @property
    def info(self) -> dict[str, object]:
        return self.stack.info

    def pid(self, name: str) -> int:
        return int(self.stack.info["pids"][name])  # type: ignore[index]

    def redis_password(self) -> str:
        """The private Redis's password, as the scheduler received it (its environment)."""
        url = environ(self.pid("scheduler-0"))["LLMSERVE_REDIS_URL"]
        password = urlsplit(url).password
        assert password
        return password


@pytest.fixture(scope="module")
def trusted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TrustStack]:
    log = tmp_path_factory.mktemp("internal-trust") / "stack.log"
    flags = [*STACK_FLAGS, "--tokenizer-replicas", "1"]
    with (
        log.open("wb") as stderr,
        # INFO: the logs checked for secrets are as talkative as they get in production.
        running_stack(
            flags,
            startup_timeout_s=STARTUP_TIMEOUT_S,
            stderr=stderr,
            env={"LLMSERVE_LOG_LEVEL": "INFO"},
        ) as stack,
    ):
        yield TrustStack(stack, log)
    assert stack.returncode == 0


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {key.decode(): value.decode(errors="replace") for key, value in pairs}


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def greedy(max_new_tokens: int, **extra: object) -> text_pb2.SamplingParams:
    return text_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **extra)


def generated_ids(trusted: TrustStack, prompt: str, max_new_tokens: int) -> list[int]:
    request = text_pb2.GenerateRequest(prompt=prompt, sampling=greedy(max_new_tokens))
    return [
        t for r in trusted.stack.text_stub().Generate(request, timeout=120) for t in r.token_ids
    ]


def code_of(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as error:
        if callable(call):
            call()
    return error.value.code()  # type: ignore[attr-defined,no-any-return]


WRONG = {
    "no secret": (),
    "a wrong secret": ((INTERNAL_SECRET_KEY, WRONG_SECRET),),
}


# ---- the Engine API ---------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", WRONG.values(), ids=WRONG.keys())
def test_scheduler_calls_need_the_internal_secret(
    trusted: TrustStack, metadata: tuple[tuple[str, str], ...]
) -> None:
    # Raw ids under another tenant's cache salt: the prefix cache of tenant "acme".
    forged = scheduler_pb2.SubmitRequest(
        prompt_token_ids=[1, 2, 3, 4],
        sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_new_tokens=2)),
        cache_salt=tenant_salt("acme"),
    )
    with grpc.insecure_channel(trusted.stack.scheduler) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        calls = {
            "Submit": lambda: list(scheduler.Submit(forged, timeout=10, metadata=metadata)),
            "GetStats": lambda: scheduler.GetStats(
                scheduler_pb2.GetStatsRequest(), timeout=10, metadata=metadata
            ),
            "Describe": lambda: scheduler.Describe(
                model_pb2.DescribeModelRequest(), timeout=10, metadata=metadata
            ),
            "Pin": lambda: scheduler.Pin(
                scheduler_pb2.PinRequest(name="p", token_ids=[1, 2], ttl_s=60.0),
                timeout=10,
                metadata=metadata,
            ),
            "Unpin": lambda: scheduler.Unpin(
                scheduler_pb2.UnpinRequest(name="p"), timeout=10, metadata=metadata
            ),
        }
        codes = {name: code_of(call) for name, call in calls.items()}
    assert codes == dict.fromkeys(calls, grpc.StatusCode.UNAUTHENTICATED)


def test_the_scheduler_answers_the_stack(trusted: TrustStack) -> None:
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=[1, 2, 3, 4],
        sampling=sampling_to_proto(SamplingParams(temperature=0.0, max_new_tokens=2)),
    )
    with grpc.insecure_channel(trusted.stack.scheduler) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        responses = list(
            scheduler.Submit(request, timeout=60, metadata=trusted.stack.internal_metadata)
        )
    assert sum(len(r.token_ids) for r in responses) == 2
    assert trusted.stack.stats().num_total_blocks > 0  # GetStats with the secret


# ---- the Worker API ---------------------------------------------------------------------------


@pytest.mark.parametrize("metadata", WRONG.values(), ids=WRONG.keys())
def test_worker_calls_need_the_internal_secret(
    trusted: TrustStack, metadata: tuple[tuple[str, str], ...]
) -> None:
    with grpc.insecure_channel(str(trusted.info["worker"])) as channel:
        worker = worker_pb2_grpc.WorkerStub(channel)
        describe = code_of(
            lambda: worker.Describe(worker_pb2.DescribeRequest(), timeout=10, metadata=metadata)
        )
        step = code_of(lambda: list(worker.Step(iter(()), timeout=10, metadata=metadata)))
        prepare = code_of(
            lambda: worker.PrepareGrammar(
                worker_pb2.PrepareGrammarRequest(
                    structured_output=sampling_pb2.StructuredOutput(regex="[a-z]+")
                ),
                timeout=10,
                metadata=metadata,
            )
        )
    assert (describe, step, prepare) == (grpc.StatusCode.UNAUTHENTICATED,) * 3


def test_a_grammar_the_worker_refuses_fails_a_direct_submit(trusted: TrustStack) -> None:
    """A client of the Engine API skips the tokenizer tier's compile: the worker's
    PrepareGrammar refuses the bad regex, the request ends INVALID_ARGUMENT naming the field
    before it is admitted, and no block stays held."""
    request = scheduler_pb2.SubmitRequest(
        prompt_token_ids=[1, 2, 3, 4],
        sampling=sampling_to_proto(
            SamplingParams(
                temperature=0.0,
                max_new_tokens=4,
                structured_output=StructuredOutput(StructuredOutputKind.REGEX, "([a-z"),
            )
        ),
    )
    with grpc.insecure_channel(trusted.stack.scheduler) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
        with pytest.raises(grpc.RpcError) as error:
            list(scheduler.Submit(request, timeout=60, metadata=trusted.stack.internal_metadata))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # type: ignore[attr-defined]
    assert "regex" in (error.value.details() or "")  # type: ignore[attr-defined]
    stats = trusted.stack.wait_all_blocks_free(timeout_s=10)
    assert stats.num_running == 0 and stats.num_waiting == 0


def test_a_second_step_stream_is_refused_while_a_request_runs_on(trusted: TrustStack) -> None:
    stack = trusted.stack
    request = text_pb2.GenerateRequest(prompt=PROMPT, sampling=greedy(64, ignore_eos=True))
    call = stack.text_stub().Generate(request, timeout=120)
    first = next(call)
    epoch = stack.stats().worker_epoch
    with grpc.insecure_channel(str(trusted.info["worker"])) as channel:
        step = worker_pb2_grpc.WorkerStub(channel).Step
        # Even with the right secret: the worker has a controller, its live scheduler.
        refused = code_of(
            lambda: list(step(iter(()), timeout=10, metadata=stack.internal_metadata))
        )
    assert refused == grpc.StatusCode.FAILED_PRECONDITION
    assert stack.stats().num_running == 1  # the request was running through the refusal
    rest = list(call)
    ids = [*first.token_ids, *(t for r in rest for t in r.token_ids)]
    assert rest[-1].finish_reason == "length" and len(ids) == 64
    # The batch was never reset: the same greedy request alone gives the same ids.
    assert generated_ids(trusted, PROMPT, 64) == ids
    assert stack.stats().worker_epoch == epoch


# ---- Redis ------------------------------------------------------------------------------------


def test_the_private_redis_needs_its_password(trusted: TrustStack) -> None:
    shown = str(trusted.info["redis_url"])
    address = urlsplit(shown)
    anonymous = redis.Redis(host=address.hostname, port=address.port, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    password = trusted.redis_password()
    assert password not in shown  # the ready file shows the URL redacted
    client = redis.Redis(
        host=address.hostname, port=address.port, password=password, socket_timeout=5
    )
    # The stack writes its prefix index with the password: blocks of a long prompt appear.
    assert len(generated_ids(trusted, LONG_PROMPT, 2)) == 2
    wait_until(
        lambda: client.keys("llmserve:v1:*:blk:scheduler-0:*"), 10, "the prefix index in Redis"
    )
    client.close()


# ---- a hung, then a restarted, scheduler ------------------------------------------------------


def take_control(trusted: TrustStack) -> bool:
    """Open a Step stream with the secret and end it at once: whether the worker took it."""
    with grpc.insecure_channel(str(trusted.info["worker"])) as channel:
        step = worker_pb2_grpc.WorkerStub(channel).Step
        try:
            list(step(iter(()), timeout=10, metadata=trusted.stack.internal_metadata))
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error
            return False
    return True


def serves(trusted: TrustStack) -> list[int] | None:
    try:
        return generated_ids(trusted, PROMPT, 4)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        return None


def test_a_hung_scheduler_loses_its_worker_after_keepalive(trusted: TrustStack) -> None:
    """A scheduler that stops answering (a half-open connection) holds its worker only until
    gRPC keepalive gives up on it (ping every 10 s, 5 s to answer); then a new controller is
    let in, and the old scheduler, once back, reconnects like a restarted one."""
    pid = trusted.pid("scheduler-0")
    os.kill(pid, signal.SIGSTOP)
    try:
        assert not take_control(trusted)  # no takeover of a stream the worker sees as live
        wait_until(lambda: take_control(trusted), 60, "keepalive dropping the hung stream", 1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert len(wait_until(lambda: serves(trusted), 120, "the scheduler back", 0.5)) == 4


def test_a_restarted_scheduler_drives_its_worker_again(trusted: TrustStack) -> None:
    old_pid = trusted.pid("scheduler-0")
    os.kill(old_pid, signal.SIGKILL)  # the stack restarts it under the same name
    assert len(wait_until(lambda: serves(trusted), 180, "a restarted scheduler", 0.5)) == 4
    assert trusted.pid("scheduler-0") != old_pid


# ---- no secret in a log or a command line (last: every call above has been logged) -----------


def test_no_secret_in_logs_or_command_lines(trusted: TrustStack) -> None:
    secret = trusted.stack.internal_secret
    assert secret
    password = trusted.redis_password()
    pids = {"launcher": trusted.stack.process.pid, **trusted.stack.info["pids"]}  # type: ignore[dict-item]
    for name, pid in pids.items():
        line = cmdline(int(pid))
        assert secret not in line and password not in line, name
        assert "--redis-url" not in line and "--internal-secret" not in line, name
        if name.startswith(("worker", "scheduler", "tokenizer")):
            # Delivered through the environment instead.
            assert environ(int(pid)).get("LLMSERVE_INTERNAL_SECRET") == secret, name
    text = trusted.log.read_text(errors="replace")
    assert "internal call refused" in text  # the log is the stack's, refusals included
    for value in (secret, password, WRONG_SECRET):
        assert value not in text
