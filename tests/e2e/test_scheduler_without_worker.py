"""A scheduler whose worker is not there: it still answers, but says so. The tokenizer tier
must get UNAVAILABLE from Describe (and wait), never a half-filled model description."""

from __future__ import annotations

import subprocess

import grpc
import pytest

from protos.llmserve.v1 import model_pb2, scheduler_pb2, scheduler_pb2_grpc
from services.launcher import free_port, llmserve_command
from services.stack import wait_until

HOST = "127.0.0.1"


def test_describe_is_unavailable_until_a_worker_connects() -> None:
    port, dead_worker = free_port(HOST), free_port(HOST)  # nothing listens on the second
    process = subprocess.Popen(
        llmserve_command(
            "scheduler", "--host", HOST, "--port", str(port), "--worker", f"{HOST}:{dead_worker}"
        )
    )
    try:
        channel = grpc.insecure_channel(f"{HOST}:{port}")
        stub = scheduler_pb2_grpc.SchedulerStub(channel)

        def answered() -> grpc.RpcError | None:
            assert process.poll() is None, "the scheduler exited"
            try:
                stub.Describe(model_pb2.DescribeModelRequest(), timeout=2)
            except grpc.RpcError as error:
                # Connection refused while it starts is also UNAVAILABLE: wait for its own
                # answer, which names the missing worker.
                return error if "worker" in (error.details() or "") else None
            pytest.fail("Describe answered without a worker")

        error = wait_until(answered, 60, "the scheduler answering")
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as stats_error:
            stub.GetStats(scheduler_pb2.GetStatsRequest(), timeout=2)
        assert stats_error.value.code() == grpc.StatusCode.UNAVAILABLE
        channel.close()
    finally:
        process.terminate()
        process.wait(timeout=30)
