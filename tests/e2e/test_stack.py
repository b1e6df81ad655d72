"""End to end through real processes: tokenizer replicas → scheduler → worker."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.contracts.sampling_params import SamplingParams
from services.launcher import free_port
from services.stack import RunningStack, running_service, wait_until

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "List three colors:\n1.",
    "def add(a, b):\n    return",
    "Once upon a time,",
]


def greedy(max_new_tokens: int = 16, **extra: object) -> text_pb2.SamplingParams:
    return text_pb2.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **extra)


def generate(
    stub: text_pb2_grpc.TextGenerationStub, timeout: float = 120, **request: object
) -> tuple[str, list[int], list[text_pb2.GenerateResponse]]:
    responses = list(stub.Generate(text_pb2.GenerateRequest(**request), timeout=timeout))
    text = "".join(r.text for r in responses)
    ids = [t for r in responses for t in r.token_ids]
    return text, ids, responses


def test_greedy_through_stack_equals_in_process_engine(
    stack: RunningStack,
    reference_engine,  # type: ignore[no-untyped-def]
) -> None:
    stub = stack.text_stub()
    for prompt in PROMPTS:
        text, ids, responses = generate(stub, prompt=prompt, sampling=greedy(24))
        expected = reference_engine.generate(
            [prompt], SamplingParams(temperature=0.0, max_new_tokens=24)
        )[0]
        assert ids == expected.token_ids, prompt
        assert text == expected.text
        last = responses[-1]
        assert last.finish_reason == expected.finish_reason.value
        assert last.usage.completion_tokens == len(ids)
        assert last.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert last.timings.total_ms >= last.timings.ttft_ms > 0


def test_chat_messages_use_the_chat_template(stack: RunningStack, reference_engine) -> None:  # type: ignore[no-untyped-def]
    from services.text.chat_template import ChatMessage

    stub = stack.text_stub()
    messages = [text_pb2.ChatMessage(role="user", content="What is 2+2?")]
    _, ids, responses = generate(stub, messages=messages, sampling=greedy(12))
    prompt_ids = reference_engine.tokenizer.apply_chat_template(
        [ChatMessage("user", "What is 2+2?")]
    )
    expected = reference_engine.generate(
        [prompt_ids], SamplingParams(temperature=0.0, max_new_tokens=12)
    )[0]
    assert ids == expected.token_ids
    assert responses[-1].usage.prompt_tokens == len(prompt_ids)


def test_32_concurrent_clients_over_two_replicas(stack: RunningStack, reference_engine) -> None:  # type: ignore[no-untyped-def]
    expected = {
        p: reference_engine.generate([p], SamplingParams(temperature=0.0, max_new_tokens=12))[
            0
        ].token_ids
        for p in PROMPTS
    }

    def one_client(index: int) -> tuple[str, list[int]]:
        # A channel per client: SO_REUSEPORT spreads connections over the replicas.
        with grpc.insecure_channel(stack.public) as channel:
            stub = text_pb2_grpc.TextGenerationStub(channel)
            prompt = PROMPTS[index % len(PROMPTS)]
            _, ids, _ = generate(stub, prompt=prompt, sampling=greedy(12))
            return prompt, ids

    with ThreadPoolExecutor(max_workers=32) as pool:
        results = list(pool.map(one_client, range(32)))
    assert len(results) == 32
    for prompt, ids in results:
        assert ids == expected[prompt], prompt
    assert stack.wait_all_blocks_free().num_free_blocks == stack.stats().num_total_blocks


def test_cancel_mid_stream_frees_every_block(stack: RunningStack) -> None:
    stub = stack.text_stub()
    call = stub.Generate(
        text_pb2.GenerateRequest(prompt=PROMPTS[0] * 20, sampling=greedy(2000, ignore_eos=True)),
        timeout=60,
    )
    for received, _ in enumerate(call, start=1):
        if received == 3:
            break
    assert stack.stats().num_free_blocks < stack.stats().num_total_blocks
    call.cancel()
    stats = stack.wait_all_blocks_free(timeout_s=1.0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == 0


def test_deadline_expiry(stack: RunningStack) -> None:
    stub = stack.text_stub()
    with pytest.raises(grpc.RpcError) as error:
        generate(stub, prompt=PROMPTS[1], sampling=greedy(5000, ignore_eos=True), deadline_ms=700)
    assert error.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stats = stack.wait_all_blocks_free(timeout_s=2.0)
    assert stats.num_free_blocks == stats.num_total_blocks


def test_queue_overflow_is_resource_exhausted(stack: RunningStack) -> None:
    # 32 waiting fit (a step admits up to 32 of them); the rest are refused at once.
    stub = stack.text_stub()
    request = text_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(3000, ignore_eos=True))
    calls = [stub.Generate(request, timeout=15) for _ in range(96)]

    def first_outcome(call: grpc.Future) -> grpc.StatusCode:
        try:
            next(iter(call))
            return grpc.StatusCode.OK
        except grpc.RpcError as exc:
            return exc.code()

    try:
        with ThreadPoolExecutor(max_workers=96) as pool:
            codes = list(pool.map(first_outcome, calls))
    finally:
        for call in calls:
            call.cancel()
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 96 - 64
    # Accepted requests either stream or, still queued behind 32 long ones, time out.
    accepted = {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}
    assert set(codes) <= {grpc.StatusCode.RESOURCE_EXHAUSTED, *accepted}
    assert sum(code in accepted for code in codes) >= 32
    stats = stack.wait_all_blocks_free(timeout_s=3.0)
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "hi " * 9000}, "prompt"),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(max_new_tokens=0)}, "max_new_tokens"),
        (
            {"prompt": "hi", "sampling": text_pb2.SamplingParams(max_new_tokens=10**8)},
            "max_new_tokens",
        ),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(temperature=-1)}, "temperature"),
        (
            {"prompt": "hi", "sampling": text_pb2.SamplingParams(temperature=math.nan)},
            "temperature",
        ),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(top_p=0)}, "top_p"),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(top_p=1.5)}, "top_p"),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(top_k=-2)}, "top_k"),
        ({"messages": [text_pb2.ChatMessage(role="wizard", content="x")]}, "role"),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(stop=["x"] * 100)}, "stop"),
        ({"prompt": "hi", "sampling": text_pb2.SamplingParams(stop=["x" * 5000])}, "stop"),
    ],
)
def test_validation_errors(stack: RunningStack, request_fields: dict, field: str) -> None:  # type: ignore[type-arg]
    before = stack.stats()
    with pytest.raises(grpc.RpcError) as error:
        generate(stack.text_stub(), **request_fields)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    if field == "prompt" and len(str(request_fields.get("prompt", ""))) > 9000:
        # Names both numbers: the prompt's length and the context length.
        assert "tokens but the context length is 8192" in error.value.details()
    after = stack.stats()
    assert after.num_free_blocks == before.num_free_blocks == after.num_total_blocks


def test_stop_string_across_token_boundaries(stack: RunningStack) -> None:
    stub = stack.text_stub()
    full, _, _ = generate(stub, prompt=PROMPTS[0], sampling=greedy(24, ignore_eos=True))
    # A stop string that starts inside one token and ends in a later one.
    start = full.index("Paris") + 2 if "Paris" in full else 3
    stop = full[start : start + 6]
    text, _, responses = generate(
        stub, prompt=PROMPTS[0], sampling=greedy(24, ignore_eos=True, stop=[stop])
    )
    assert text == full[: full.index(stop)]
    assert stop not in text
    assert responses[-1].finish_reason == "stop"
    stats = stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_multibyte_characters_never_break(stack: RunningStack) -> None:
    stub = stack.text_stub()
    prompt = "Repeat exactly: 東京 😀 café 🎉🎉 naïve"
    responses = list(
        stub.Generate(
            text_pb2.GenerateRequest(
                messages=[text_pb2.ChatMessage(role="user", content=prompt)],
                sampling=greedy(40),
            ),
            timeout=120,
        )
    )
    for response in responses:
        assert "\ufffd" not in response.text
    text = "".join(r.text for r in responses)
    ids = [t for r in responses for t in r.token_ids]
    detok = stack.text_stub().Detokenize(
        text_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=True)
    )
    assert text == detok.text


def test_tokenize_detokenize_list_models(stack: RunningStack) -> None:
    stub = stack.text_stub()
    tokens = stub.Tokenize(text_pb2.TokenizeRequest(text="Hello world"))
    assert len(tokens.token_ids) >= 2
    assert stub.Detokenize(text_pb2.DetokenizeRequest(token_ids=tokens.token_ids)).text == (
        "Hello world"
    )
    models = stub.ListModels(text_pb2.ListModelsRequest()).models
    assert models[0].name == "SmolLM2-135M-Instruct"
    assert models[0].max_model_len == 8192
    # The worker's formats, as its scheduler reports them (this stack: fp32 activations over
    # the GGUF file's own blocks, what --quantization auto keeps, and llama.cpp's float16 KV
    # cache, which auto picks under gguf's arithmetic).
    assert (models[0].dtype, models[0].kv_cache_dtype, models[0].quantization) == (
        "float32",
        "float16",
        "gguf",
    )


def test_health_and_reflection(stack: RunningStack) -> None:
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    for address in (stack.public, stack.scheduler, stack.info["worker"]):
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert status.status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            replies = stub.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
            names = {s.name for r in replies for s in r.list_services_response.service}
            assert "grpc.health.v1.Health" in names


def test_sigterm_drains_in_flight_streams(stack: RunningStack) -> None:
    port = free_port("127.0.0.1")
    # A drain long enough for the stream on a loaded machine: a drain that runs out cancels
    # it (seen once with the suite's workers sharing 2 cores), which is not what is tested.
    args = ["tokenizer", "--port", str(port), "--scheduler", stack.scheduler, "--drain-s", "120"]
    args += ["--http-port", str(free_port("127.0.0.1"))]
    with running_service(args, port, env=stack.child_env) as replica:
        channel = grpc.insecure_channel(replica.address)
        stub = text_pb2_grpc.TextGenerationStub(channel)
        call = stub.Generate(
            text_pb2.GenerateRequest(prompt=PROMPTS[2], sampling=greedy(48, ignore_eos=True)),
            timeout=120,
        )
        first = next(call)
        replica.process.send_signal(signal.SIGTERM)

        def refuses_new_calls() -> bool:
            try:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.RpcError as exc:
                return exc.code() == grpc.StatusCode.UNAVAILABLE
            return False

        wait_until(refuses_new_calls, 10, "the replica draining")
        with pytest.raises(grpc.RpcError) as error:
            list(
                stub.Generate(
                    text_pb2.GenerateRequest(prompt="new", sampling=greedy(4)), timeout=10
                )
            )
        assert error.value.code() == grpc.StatusCode.UNAVAILABLE
        rest = list(call)
        assert rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 48
        assert replica.process.wait(timeout=150) == 0


def test_zz_worker_death_then_recovery(stack: RunningStack) -> None:
    """Runs last in this module: it kills the worker (the stack restarts it)."""
    stub = stack.text_stub()
    call = stub.Generate(
        text_pb2.GenerateRequest(prompt=PROMPTS[0], sampling=greedy(4000, ignore_eos=True)),
        timeout=120,
    )
    next(call)
    old_pid = stack.info["pids"]["worker-0"]
    killed_at = time.monotonic()
    os.kill(old_pid, signal.SIGKILL)
    with pytest.raises(grpc.RpcError) as error:
        list(call)
    assert error.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - killed_at < 5.0
    # The stack restarts the worker; the scheduler reconnects on its own.

    def served() -> list[int] | None:
        try:
            return generate(stub, prompt=PROMPTS[0], sampling=greedy(8), timeout=30)[1]
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
            return None

    ids = wait_until(served, 180, "recovery after the worker restart", interval_s=0.5)
    assert len(ids) == 8
    assert stack.info["pids"]["worker-0"] != old_pid
    stats = stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_cli_client_streams_and_reports_errors(stack: RunningStack, reference_engine) -> None:  # type: ignore[no-untyped-def]
    import json

    command = [sys.executable, "-m", "services.cli", "generate", "--target", stack.public]
    done = subprocess.run(
        [*command, "--prompt", PROMPTS[0], "--temperature", "0", "--max-new-tokens", "8", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    messages = [json.loads(line) for line in done.stdout.splitlines()]
    ids = [int(t) for m in messages for t in m.get("token_ids", [])]
    expected = reference_engine.generate(
        [PROMPTS[0]], SamplingParams(temperature=0.0, max_new_tokens=8)
    )[0]
    assert ids == expected.token_ids
    bad = subprocess.run(
        [*command, "--prompt", "hi", "--top-p", "1.5", "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert bad.returncode != 0
    assert json.loads(bad.stdout.splitlines()[-1])["error"]["code"] == "INVALID_ARGUMENT"
    # Two greedy choices: printed whole, one after the other, the same text.
    two = subprocess.run(
        [
            *command,
            "--prompt",
            PROMPTS[0],
            "--temperature",
            "0",
            "--max-new-tokens",
            "8",
            "--n",
            "2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert two.returncode == 0, two.stderr
    first, second = two.stdout.split("--- choice 1 ---\n")
    assert first.startswith("--- choice 0 ---\n")
    assert (
        first.removeprefix("--- choice 0 ---\n").strip() == second.strip() == expected.text.strip()
    )


def test_bench_serve_against_the_stack_writes_json(stack: RunningStack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            *(sys.executable, "-m", "services.cli", "bench", "serve"),
            *("--target", f"grpc://{stack.public}", "--num-prompts", "4"),
            *("--concurrency", "1,2", "--input-len", "16", "--output-len", "6"),
            *("--json-out", str(out)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    points = json.loads(out.read_text())["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for point in points:
        summary = point["summary"]
        assert summary["num_completed"] == 4 and summary["errors"] == {}
        assert summary["output_tokens"] == 4 * 6  # ignore_eos: exactly the output length
        assert summary["prompt_tokens"] == 4 * 16
        for request in point["requests"]:
            assert 0 < request["ttft_s"] <= request["end_time_s"] - request["send_time_s"]
            assert request["tpot_s"] > 0
    assert "TTFT" in done.stdout
