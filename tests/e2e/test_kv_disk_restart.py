"""The KV disk tier through a real stack: `llmserve up --kv-disk-dir` stopped and started
again on the same directory serves a long prompt's full blocks from disk, with the greedy ids
of the first run (exact fp32 arithmetic, so a block loaded from disk must equal one computed);
and a worker SIGKILLed while it writes blocks leaves nothing that is used afterwards: its
half-written `.tmp` files are swept when the stack restarts it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack, wait_serving, wait_until
from services.worker.kv_disk_lock import DirectoryLock
from tests.e2e.conftest import e2e_stack
from tests.redis_server import RedisServer

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
NEW_TOKENS = 8
EXACT = ["--quantization", "gguf-exact", "--no-redis"]

PROMPT = (
    "The lighthouse keeper kept a journal of every ship that passed the point, the weather "
    "of each morning, the colour of the sea at noon and the names of the gulls he had come "
    "to know. In the winter the storms came from the north and the lamp had to be trimmed "
    "every hour; in the summer the evenings were long and he read by the last of the light. "
    "One autumn a small boat with a torn sail drifted into the cove, and in it a girl who "
    "said she had rowed from the islands to find her brother. Tell the rest of the story."
)
"""Several full blocks of the embedded model's tokens (about 120)."""
OTHER_PROMPT = (
    "A clockmaker in a mountain town repaired every clock in the valley except his own, "
    "which had stopped at a quarter past three on the day his apprentice left for the city. "
    "Each spring the apprentice wrote a letter, and each spring the clockmaker read it by the "
    "window and put it in a drawer with the others. Write the letter of the tenth spring."
)


def generate(stack: RunningStack, prompt: str) -> tuple[list[int], text_pb2.Usage]:
    request = text_pb2.GenerateRequest(
        prompt=prompt,
        sampling=text_pb2.SamplingParams(
            temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True
        ),
    )
    ids: list[int] = []
    usage = text_pb2.Usage()
    for response in stack.text_stub().Generate(request, timeout=120):
        ids.extend(response.token_ids)
        if response.HasField("usage"):
            usage = response.usage
    return ids, usage


def http_completion(stack: RunningStack, prompt: str) -> tuple[str, int]:
    """The greedy text and usage.prompt_tokens_details.cached_tokens of /v1/completions, by
    the official client."""
    client = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)
    model = str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])
    answer = client.completions.create(
        model=model, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0.0
    )
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    return answer.choices[0].text, answer.usage.prompt_tokens_details.cached_tokens or 0


def full_block_tokens(prompt_tokens: int) -> int:
    """The prompt tokens in full blocks a hit can cover (the last token is always computed)."""
    return (prompt_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE


def block_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if not p.name.startswith(".")]


def test_a_restarted_stack_serves_a_long_prompt_from_its_disk_tier(tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    flags = [*EXACT, "--kv-disk-dir", str(kv_dir)]
    with e2e_stack(flags) as first:
        first_ids, first_usage = generate(first, PROMPT)
        other_ids, _ = generate(first, OTHER_PROMPT)
        first_text, _ = http_completion(first, PROMPT)
    assert first.returncode == 0  # a graceful stop: the writer wrote what was queued
    assert first_usage.cached_prompt_tokens == 0
    assert first_usage.prompt_tokens >= 6 * BLOCK_SIZE
    pair_dir = kv_dir / "pair-0"
    assert len(block_files(pair_dir)) >= first_usage.prompt_tokens // BLOCK_SIZE
    # What a worker killed mid-write leaves: a half-written file under its temporary name.
    planted = pair_dir / f"{'ab' * 32}.12345.tmp"
    planted.write_bytes(b"LLMKVD01" + b"\x00" * 40)

    with e2e_stack(flags) as second:
        assert not planted.exists()  # swept at start, never indexed
        ids, usage = generate(second, PROMPT)
        assert ids == first_ids
        assert usage.prompt_tokens == first_usage.prompt_tokens
        assert usage.cached_prompt_tokens >= full_block_tokens(usage.prompt_tokens)

        # The OpenAI door reports it as usage.prompt_tokens_details.cached_tokens.
        text, cached = http_completion(second, PROMPT)
        assert text == first_text
        assert cached >= full_block_tokens(usage.prompt_tokens)

        # SIGKILL the worker while it copies a fresh prompt's blocks out and writes them.
        fresh = "In a different voice. " + OTHER_PROMPT
        request = text_pb2.GenerateRequest(
            prompt=fresh,
            sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=64, ignore_eos=True),
        )
        worker_pid = int(second.info["pids"]["worker-0"])
        with pytest.raises(grpc.RpcError):
            for _ in second.text_stub().Generate(request, timeout=120):
                os.kill(worker_pid, signal.SIGKILL)  # at the first token: its blocks are cached
        # The stack restarts the worker on the same directory (the kernel dropped its lock).
        wait_until(
            lambda: int(second.info["pids"]["worker-0"]) != worker_pid, 60, "the worker restart"
        )
        wait_serving(second.info["workers"][0], 300)
        wait_serving(second.scheduler, 300)
        wait_until(lambda: _answers(second), 120, "the pair serving again")
        assert not list(pair_dir.glob("*.tmp"))
        # Whatever the kill left is either whole and checked, or gone: answers do not move.
        assert generate(second, OTHER_PROMPT)[0] == other_ids
        ids, usage = generate(second, PROMPT)
        assert ids == first_ids
        assert usage.cached_prompt_tokens >= full_block_tokens(usage.prompt_tokens)
    assert second.returncode == 0


def test_after_a_restart_routing_sends_a_prefix_to_the_pair_whose_disk_holds_it(
    tmp_path: Path,
) -> None:
    """Two pairs behind one Redis: after a restart every pool is empty, so only the index's
    disk entries (published under the new worker epochs) can tell the tier which pair holds a
    prefix; the other pair would compute it again."""
    kv_dir = tmp_path / "kv"
    redis = RedisServer().start()
    flags = ["--workers", "2", "--tokenizer-replicas", "1", "--redis-url", redis.url]
    flags += ["--kv-disk-dir", str(kv_dir)]
    topics = ("rivers", "comets", "violins", "glaciers")
    try:
        with e2e_stack(flags) as first:
            answers = {topic: generate(first, _notes(topic))[0] for topic in topics}
        assert first.returncode == 0
        # The prompts were spread over both pairs, so a blind choice would miss some.
        assert all(block_files(kv_dir / f"pair-{index}") for index in (0, 1))
        with e2e_stack(flags) as second:
            # In the reverse order: ties are broken by turn, so the first run's order alone
            # would land each prompt on its pair again.
            for topic in reversed(topics):
                ids, usage = generate(second, _notes(topic))
                assert ids == answers[topic], topic
                assert usage.cached_prompt_tokens >= full_block_tokens(usage.prompt_tokens), topic
        assert second.returncode == 0
    finally:
        redis.stop()


def _notes(topic: str) -> str:
    return f"Notes about {topic}. " + " ".join(f"{topic} fact number {i}." for i in range(30))


def test_a_second_worker_on_a_taken_directory_stops_before_loading_its_model(
    tmp_path: Path,
) -> None:
    held = DirectoryLock(tmp_path)  # as a live worker holds it
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.cli",
            "worker",
            "--port",
            "0",
            "--kv-disk-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    held.release()
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        f"llmserve: error: --kv-disk-dir {tmp_path} is in use by another worker "
        f"(pid {os.getpid()}); give each worker its own directory"
    )
    assert "Traceback" not in done.stderr
    # Refused before the weights load: a model load alone takes longer on this machine.
    assert time.monotonic() - started < 30


def _answers(stack: RunningStack) -> bool:
    try:
        generate(stack, "Hello.")
    except grpc.RpcError:
        time.sleep(0.5)
        return False
    return True
