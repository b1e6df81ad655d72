"""Disaggregation with the gRPC byte stream, the transport between workers on two hosts
(docs/disaggregation.md, Transport): the workers are started without a shared-memory directory
(LLMSERVE_KV_TRANSFER_SHM_DIR empty), so this one-host stack moves the KV as it would across
hosts. Greedy ids of long prompts equal a colocated stack's (exact arithmetic), every byte
sent is received, and no transfer went through shared memory."""

from __future__ import annotations

import pytest

from services.common.config_flags import env_name
from services.stack import running_stack
from tests.e2e.conftest import STACK_FLAGS, STARTUP_TIMEOUT_S, e2e_stack
from tests.e2e.test_disaggregation import (
    COMMON_FLAGS,
    LONG_PROMPTS,
    counter,
    greedy_ids,
    histogram_count,
    shm_files_of,
)

pytestmark = pytest.mark.slow

PROMPTS = LONG_PROMPTS[:2]


def test_the_byte_stream_moves_the_kv_when_shared_memory_is_off() -> None:
    with e2e_stack(COMMON_FLAGS) as colocated:
        expected = [greedy_ids(colocated, prompt) for prompt in PROMPTS]
    flags = [*STACK_FLAGS, *COMMON_FLAGS, "--prefill-pairs", "1", "--decode-pairs", "1"]
    no_shm = {env_name("kv_transfer_shm_dir"): ""}
    with running_stack(flags, startup_timeout_s=STARTUP_TIMEOUT_S, env=no_shm) as stack:
        assert [greedy_ids(stack, prompt) for prompt in PROMPTS] == expected
        sent = counter(stack, "worker-0", "llmserve_kv_transfer_bytes_total")
        received = counter(stack, "worker-1", "llmserve_kv_transfer_bytes_total")
        assert sent == received > 0
        assert counter(stack, "worker-0", "llmserve_kv_transfers_shm_total") == 0
        assert counter(stack, "worker-1", "llmserve_kv_transfers_shm_total") == 0
        remote = histogram_count(stack, "scheduler-1", "llmserve_remote_prefill_seconds", "done")
        assert remote >= len(PROMPTS)
        assert shm_files_of(stack) == []
