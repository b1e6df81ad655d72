"""The pure modules (no gRPC, Redis, torch or clock reads) type-check under the [tool.mypy]
settings in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PURE_MODULES = (
    # the scheduler's logic: scheduler, KV manager, block pool (with its prefix cache), the
    # allocation policy (config), the sliding-window release, the request state and the
    # Submit stream's event merging
    "services/scheduler/scheduler.py",
    "services/scheduler/request_book.py",
    "services/scheduler/kv_cache_manager.py",
    "services/scheduler/features/sliding_window.py",
    "services/scheduler/block_pool.py",
    "services/scheduler/config.py",
    "services/scheduler/request.py",
    "services/scheduler/features/coalesce.py",
    "services/scheduler/features/retry_hint.py",
    "services/scheduler/features/speculation_policy.py",
    "services/scheduler/features/draft_slots.py",
    "services/scheduler/features/plan_edits.py",
    "services/scheduler/features/choices.py",
    "services/scheduler/features/pins.py",
    "services/scheduler/features/pin_keeper.py",
    "services/scheduler/features/admission.py",
    "services/scheduler/stats.py",
    "services/scheduler/features/fair_share.py",
    "services/scheduler/features/lora_admission.py",
    "services/scheduler/features/grammar_readiness.py",
    # the model registry: architectures and what each family reads from its files
    "services/worker/model/architecture.py",
    "services/worker/model/families",
    "services/worker/model/architecture_switches.py",
    # the worker's draft proposer (prompt lookup)
    "services/worker/speculative/ngram_proposer.py",
    # the tokenizer tier's logic
    "services/tokenizer/routing/policy.py",
    "services/tokenizer/routing/membership.py",
    "services/text/detokenizer.py",
    "services/text/stop_strings.py",
    "services/tokenizer/validation.py",
    "services/tokenizer/http/json_body.py",
    "services/tokenizer/output.py",
    "services/text/reasoning.py",
    "services/text/partial_tags.py",
    "services/text/tool_call_parsers.py",
    "services/tokenizer/tool_output.py",
    "services/text/forced_calls.py",
    "services/tokenizer/tool_request.py",
    "services/tokenizer/access/limits.py",
    # the Anthropic door's bodies, responses and errors
    "services/tokenizer/http/anthropic/schemas.py",
    "services/tokenizer/http/anthropic/responses.py",
    "services/tokenizer/http/anthropic/errors.py",
    # strict decoding of public requests
    "services/common/request_decoding.py",
    # a GGUF file's tokenizer, as llama.cpp builds it
    "services/common/gguf_metadata.py",
    "services/text/gguf_vocab.py",
    "services/text/gguf_pretokenizers.py",
    # chat templates known by name, and continuing a conversation's last message
    "services/text/builtin_chat_templates.py",
    "services/text/chat_continuation.py",
    # the shapes shared between services
    "services/contracts",
)


def test_pure_modules_type_check() -> None:
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    run = subprocess.run(
        [sys.executable, "-m", "mypy", *PURE_MODULES],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
