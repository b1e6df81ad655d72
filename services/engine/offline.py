"""Offline batch inference: JSONL requests in, JSONL results out (in input order).

Each input line is one object with exactly one of `prompt` (text), `messages` ([{role,
content}], rendered with the model's chat template) or `prompt_token_ids`, an optional `id`
echoed back, and an optional `sampling` object with SamplingParams fields. A bad line yields
an `error` object on its output line; the others still run.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields
from typing import Any, TextIO

from tqdm import tqdm

from services.contracts.errors import CapacityError, InvalidRequestError
from services.contracts.sampling_params import SamplingParams, logit_bias_from_json
from services.engine.engine import LLMEngine
from services.text.chat_template import ChatMessage

_SAMPLING_FIELDS = {f.name: f for f in fields(SamplingParams)}
_PROMPT_KEYS = ("prompt", "messages", "prompt_token_ids")
# Requests kept queued in the engine at once; the rest wait in the input file.
_MAX_IN_FLIGHT = 512


def parse_sampling(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise InvalidRequestError("sampling", "must be an object")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key not in _SAMPLING_FIELDS:
            raise InvalidRequestError(f"sampling.{key}", "unknown field")
        if key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise InvalidRequestError("sampling.stop_token_ids", "must be a list of ints")
            value = tuple(value)
        elif key == "logit_bias":
            value = logit_bias_from_json(value, "sampling.logit_bias")
        elif key == "allowed_token_ids":
            if value is not None and (
                not isinstance(value, list) or not all(isinstance(v, int) for v in value)
            ):
                raise InvalidRequestError("sampling.allowed_token_ids", "must be a list of ints")
            value = None if value is None else tuple(value)
        elif key == "seed" and value is not None and not isinstance(value, int):
            raise InvalidRequestError("sampling.seed", "must be an integer")
        elif key != "seed" and isinstance(value, bool) != (key == "ignore_eos"):
            raise InvalidRequestError(f"sampling.{key}", f"has the wrong type: {value!r}")
        values[key] = value
    params = SamplingParams(**values)
    try:
        params.validate()
    except InvalidRequestError as exc:  # name the field where it sits in the input line
        raise InvalidRequestError(f"sampling.{exc.field}", exc.message) from exc
    if params.n != 1:
        # A line's result holds one completion; repeat the line (with seeds) for more.
        raise InvalidRequestError("sampling.n", "offline lines take n = 1")
    return params


def parse_prompt(engine: LLMEngine, line: dict[str, Any]) -> list[int]:
    given = [key for key in _PROMPT_KEYS if key in line]
    if len(given) != 1:
        raise InvalidRequestError(
            "prompt", "give exactly one of prompt, messages, prompt_token_ids"
        )
    key = given[0]
    value = line[key]
    if key == "prompt":
        if not isinstance(value, str) or not value:
            raise InvalidRequestError("prompt", "must be a non-empty string")
        return engine.tokenizer.encode(value)
    if key == "messages":
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("content"), str) for m in value
        ):
            raise InvalidRequestError("messages", "must be a list of {role, content} objects")
        messages = [ChatMessage(str(m.get("role")), m["content"]) for m in value]
        return engine.tokenizer.apply_chat_template(messages)
    if not isinstance(value, list) or not all(isinstance(t, int) for t in value):
        raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
    return list(value)


@dataclass(slots=True)
class _Slot:
    line_id: Any
    token_ids: list[int]
    result: dict[str, Any] | None = None


def run_offline(
    engine: LLMEngine, lines: Iterable[str], output: TextIO, *, show_progress: bool = True
) -> int:
    """Run every request; write results in input order. Returns the number of failed lines."""
    parsed = list(_parse_lines(engine, lines))
    slots = [_Slot(line_id, []) for line_id, _, _ in parsed]
    bar = tqdm(
        total=len(parsed), desc="generating", unit="req", disable=not show_progress, file=sys.stderr
    )
    failures = 0
    index_of: dict[str, int] = {}
    pending = iter(enumerate(parsed))
    next_to_write = 0

    def admit() -> None:
        nonlocal failures
        while len(index_of) < _MAX_IN_FLIGHT:
            item = next(pending, None)
            if item is None:
                return
            index, (_, request, error) = item
            if error is None:
                try:
                    prompt, sampling = request
                    request_id = engine.add_request(prompt, sampling, request_id=f"line-{index}")
                    index_of[request_id] = index
                    continue
                except (InvalidRequestError, CapacityError) as exc:
                    error = _error_object(exc)
            slots[index].result = {"error": error}
            failures += 1
            bar.update(1)

    def flush() -> None:
        nonlocal next_to_write
        while next_to_write < len(slots) and slots[next_to_write].result is not None:
            slot = slots[next_to_write]
            record = {"id": slot.line_id} if slot.line_id is not None else {}
            record.update(slot.result or {})
            output.write(json.dumps(record, ensure_ascii=False) + "\n")
            slot.result = {}  # written; keep a non-None marker without the payload
            next_to_write += 1

    admit()
    flush()
    while engine.has_unfinished_requests():
        for event in engine.step():
            index = index_of.get(event.request_id)
            if index is None:
                continue
            slot = slots[index]
            slot.token_ids.extend(event.new_token_ids)
            if event.finish_reason is None:
                continue
            prompt_tokens = event.num_prompt_tokens
            slot.result = {
                "token_ids": slot.token_ids,
                "text": engine.tokenizer.decode(slot.token_ids),
                "finish_reason": event.finish_reason.value,
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": len(slot.token_ids),
                    "cached_prompt_tokens": event.num_cached_tokens,
                },
            }
            del index_of[event.request_id]
            bar.update(1)
        admit()
        flush()
    flush()
    bar.close()
    return failures


def _parse_lines(
    engine: LLMEngine, lines: Iterable[str]
) -> Iterator[tuple[Any, tuple[list[int], SamplingParams] | None, dict[str, str] | None]]:
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        line_id = None
        try:
            line = json.loads(text)
            if not isinstance(line, dict):
                raise InvalidRequestError("line", f"line {number} is not a JSON object")
            line_id = line.get("id")
            request = (parse_prompt(engine, line), parse_sampling(line.get("sampling")))
            yield line_id, request, None
        except json.JSONDecodeError as exc:
            yield None, None, {"field": "line", "message": f"line {number}: {exc}"}
        except InvalidRequestError as exc:
            yield line_id, None, _error_object(exc)


def _error_object(exc: Exception) -> dict[str, str]:
    field = getattr(exc, "field", "request")
    message = getattr(exc, "message", str(exc))
    return {"field": field, "message": message}
