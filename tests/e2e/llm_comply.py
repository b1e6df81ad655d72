"""llm-comply (a published compliance suite per API: Open Responses, OpenAI Chat, Anthropic
Messages) run against a real stack: list a group's tests, run them, and hold the results to
"every applicable test passes". The door's test files say which tests do not apply (what the
served model has not, such as image input) and which llm-comply's own capability gate skips.

llm-comply's requests set no temperature, and the OpenAI ones no limit: a sampled answer of the
small model that never says EOS runs to the context's end, so its stacks serve a short context
(`--max-model-len 1024`) where such an answer ends within seconds.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

import httpx

from services.stack import RunningStack

SHORT_CONTEXT_FLAGS = ["--max-model-len", "1024"]
RUN_TIMEOUT_S = 1800
REQUEST_TIMEOUT_S = 300
# What llm-comply says of a sampled answer the short context rightly cut, per group: an Open
# Responses answer is `incomplete` (where a test expects it completed), a Chat answer ends for
# `length` (its requests set no max_tokens: only the context ends it so; where a test expects
# a tool call, the missing call is reported beside it), a Messages answer stops for the
# context window (where a test expects its tool call).
CUT_BY_THE_CONTEXT = {
    "open-responses": "expected status='completed', got 'incomplete'",
    "openai-chat": "got 'length'",
    "anthropic": "got 'model_context_window_exceeded'",
}


# Reruns of a test whose sampled answer the context cut. Each answer is a fresh draw, so a
# test fails only if every draw runs long: at two reruns the OpenAI Chat tool-calling test
# still failed once in a full suite (three draws cut), at four that takes five in a row.
RERUNS_OF_A_CUT = 4


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "llm_comply.cli", *args]


def group_ids(group: str) -> list[str]:
    """The ids of llm-comply's tests in `group` (its `--format`), in its order."""
    listed = subprocess.run(
        cli("--list", "--format", group), capture_output=True, text=True, check=True
    ).stdout
    # "  <id>   <name>" lines; the descriptions under them are indented further.
    return [
        line.split()[0] for line in listed.splitlines() if line.startswith("  ") and line[2] != " "
    ]


def model_name(stack: RunningStack, api_key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    answer = httpx.get(f"{stack.http}/models", headers=headers, timeout=10)
    return str(answer.json()["data"][0]["id"])


def run(
    stack: RunningStack, group: str, ids: list[str], api_key: str = "unused"
) -> dict[str, dict[str, Any]]:
    """llm-comply's results for the tests `ids` of `group` against `stack`, by id."""
    answer = subprocess.run(
        cli(
            *("--format", group, "--base-url", stack.http, "--api-key", api_key),
            *("--model", model_name(stack, api_key), "--filter", ",".join(ids)),
            *("--json", "--timeout", str(REQUEST_TIMEOUT_S)),
        ),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert answer.stdout, answer.stderr[-3000:]
    report = json.loads(answer.stdout)
    results = {result["id"]: result for result in report["results"]}
    passed = [i for i, r in results.items() if r["status"] == "passed"]
    assert report["summary"]["passed"] == len(passed), report["summary"]
    return results


def assert_group_passes(
    stack: RunningStack,
    group: str,
    *,
    basic_test: str,
    not_applicable: Mapping[str, str],
    gated: Mapping[str, str | None],
    api_key: str = "unused",
) -> None:
    """`basic_test` is one of `group`'s tests, and every test but the `not_applicable` ones
    passes, except those llm-comply's own gate skips, which must be `gated` ones (with that
    reason in their message, where one is given). A test failed by an answer the short context
    cut (CUT_BY_THE_CONTEXT among its errors; the others then follow from the cut, such as a
    tool call the answer never reached) runs again, up to RERUNS_OF_A_CUT times; any other
    failure stands."""
    ids = group_ids(group)
    assert basic_test in ids and set(not_applicable) <= set(ids), ids
    applicable = [i for i in ids if i not in not_applicable]
    results = run(stack, group, applicable, api_key)
    assert set(results) == set(applicable), set(applicable) ^ set(results)
    marker = CUT_BY_THE_CONTEXT.get(group)
    for _ in range(RERUNS_OF_A_CUT if marker else 0):
        cut = [
            i
            for i, r in results.items()
            if r["status"] == "failed" and any(marker in error for error in r.get("errors") or [])
        ]
        if not cut:
            break
        results.update(run(stack, group, cut, api_key))
    failed = {i: r.get("errors") for i, r in results.items() if r["status"] == "failed"}
    assert failed == {}, failed
    skipped = {i: r.get("errors") for i, r in results.items() if r["status"] == "skipped"}
    assert set(skipped) <= set(gated), skipped
    for test_id, errors in skipped.items():
        reason = gated[test_id]
        assert reason is None or reason in " ".join(errors or []), errors
    passed = [i for i, r in results.items() if r["status"] == "passed"]
    assert len(passed) == len(applicable) - len(skipped)
