"""The Open Responses object and stream events built from pipeline deltas (pure)."""

from __future__ import annotations

import json
from pathlib import Path

from services.contracts.usage import Usage
from services.text.tool_call_parsers import ToolCallDelta
from services.tokenizer.http.openai.responses_api.builder import ResponseObject
from services.tokenizer.output import OutputDelta

USAGE = Usage(prompt_tokens=5, completion_tokens=3, cached_prompt_tokens=1)


def built(*deltas: OutputDelta) -> tuple[ResponseObject, list[dict[str, object]]]:
    response = ResponseObject("resp_1", {"model": "m"})
    events = response.start()
    for delta in deltas:
        events += response.events(delta)
    events.append(response.finish())
    return response, events


def test_text_stream_lifecycle_and_sequence_numbers() -> None:
    _, events = built(
        OutputDelta("Hel", token_ids=(1,)),
        OutputDelta("lo", token_ids=(2, 3), finish_reason="stop", usage=USAGE),
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert isinstance(final, dict)
    assert final["status"] == "completed"
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["total_tokens"] == 8
    assert final["usage"]["input_tokens_details"] == {"cached_tokens": 1}
    # The added item was a snapshot: still empty and in progress.
    added = events[2]["item"]
    assert isinstance(added, dict)
    assert added["status"] == "in_progress" and added["content"] == []


def test_length_finish_is_incomplete() -> None:
    _, events = built(OutputDelta("a", finish_reason="length", usage=USAGE))
    final = events[-1]
    assert final["type"] == "response.incomplete"
    body = final["response"]
    assert isinstance(body, dict)
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}


def test_call_pieces_join_into_arguments() -> None:
    response, events = built(
        OutputDelta("", tool_calls=(ToolCallDelta(0, "call_1", "get_weather", '{"city": '),)),
        OutputDelta("", tool_calls=(ToolCallDelta(0, arguments='"Paris"}'),)),
        OutputDelta("", finish_reason="tool_calls", usage=USAGE),
    )
    deltas = [e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"]
    done = next(e for e in events if e["type"] == "response.function_call_arguments.done")
    assert "".join(str(d) for d in deltas) == done["arguments"] == '{"city": "Paris"}'
    item = response.body("completed")["output"][0]
    assert item["type"] == "function_call"
    assert item["call_id"] == "call_1" and item["name"] == "get_weather"
    assert json.loads(item["arguments"]) == {"city": "Paris"}
    assert events[-1]["type"] == "response.completed"


def test_reasoning_then_text_are_two_items() -> None:
    response, _ = built(
        OutputDelta("", reasoning_text="think"),
        OutputDelta("answer", finish_reason="stop", usage=USAGE),
    )
    output = response.body("completed")["output"]
    assert [item["type"] for item in output] == ["reasoning", "message"]
    assert output[0]["content"] == [{"type": "reasoning_text", "text": "think"}]


def test_objects_and_events_match_the_spec_schema() -> None:
    """Every event of a stream with reasoning, text and a call, and the final object, against
    the Open Responses OpenAPI schema (as llm-comply ships it)."""
    import llm_comply.specs
    from llm_comply.schema import SpecLoader

    spec = SpecLoader(str(Path(llm_comply.specs.__file__).parent / "openresponses.json"))
    assert spec.spec_version == "2026-04-24"
    echo = {
        "model": "m",
        "instructions": None,
        "max_output_tokens": None,
        "temperature": 1.0,
        "top_p": 1.0,
        "tools": [
            {"type": "function", "name": "f", "description": None, "parameters": {}, "strict": None}
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "previous_response_id": None,
        "reasoning": {"effort": None, "summary": None},
        "store": True,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": {},
        "user": None,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "top_logprobs": 0,
        "background": False,
        "service_tier": "default",
        "max_tool_calls": None,
        "prompt_cache_key": None,
        "safety_identifier": None,
    }
    response = ResponseObject("resp_1", echo)
    events = response.start()
    for delta in (
        OutputDelta("", reasoning_text="hmm"),
        OutputDelta("Hi", token_ids=(1,)),
        OutputDelta("", tool_calls=(ToolCallDelta(0, "call_1", "f", "{}"),)),
        OutputDelta("", finish_reason="tool_calls", usage=USAGE),
    ):
        events += response.events(delta)
    events.append(response.finish())
    for event in events:
        assert spec.validate_sse_event(str(event["type"]), event) == [], event["type"]
    assert spec.validate(response.body("completed"), "ResponseResource") == []


def test_an_answer_that_ends_at_once_is_one_empty_message() -> None:
    """The end token first: still one message item (clients read output[0]), with no delta."""
    _, events = built(OutputDelta("", token_ids=(0,), finish_reason="stop", usage=USAGE))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    final = events[-1]["response"]
    assert isinstance(final, dict)
    assert [item["type"] for item in final["output"]] == ["message"]
    assert final["output"][0]["content"][0]["text"] == ""
    assert final["output"][0]["status"] == "completed"
