"""Stored responses without Redis: one tokenizer replica keeps them in memory, and `retrieve`,
`delete` and `previous_response_id` work as with Redis."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from services.stack import RunningStack
from tests.e2e.conftest import e2e_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack() -> Iterator[RunningStack]:
    # One replica: each keeps its own memory store (the port is shared by SO_REUSEPORT).
    with e2e_stack(["--no-redis", "--tokenizer-replicas", "1"]) as running:
        yield running
    assert running.returncode == 0


def test_memory_store_serves_retrieve_chain_and_delete(stack: RunningStack) -> None:
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=300)
    model = str(httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"])
    first = api.responses.create(model=model, input="Hi, I am Ada.", max_output_tokens=6)
    assert api.responses.retrieve(first.id).output_text == first.output_text
    second = api.responses.create(
        model=model, input="Who am I?", previous_response_id=first.id, max_output_tokens=6
    )
    assert second.previous_response_id == first.id
    api.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        api.responses.create(model=model, input="Again?", previous_response_id=first.id)
