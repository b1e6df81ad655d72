"""n > 1 choices on a real stack: the prompt computed once and its KV blocks shared by the
choices (the scheduler's GetStats counters say so), every block free afterwards, also after a
cancel mid-stream; seeds per choice; both doors (gRPC Generate, the official `openai` client)."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest

from protos.llmserve.v1 import text_pb2
from services.stack import RunningStack, wait_until

pytestmark = pytest.mark.slow

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle. " * 3


def prompt_ids(stack: RunningStack, length_mod_block: int = 5) -> list[int]:
    """PROMPT's ids, cut so that prompt_len - 1 ends inside a block: a partial last block."""
    ids = list(
        stack.text_stub().Tokenize(text_pb2.TokenizeRequest(text=PROMPT), timeout=10).token_ids
    )
    block_size = stack.stats().block_size
    length = (len(ids) - length_mod_block) // block_size * block_size + length_mod_block
    assert length > 2 * block_size
    return ids[:length]


def by_choice(responses: list[text_pb2.GenerateResponse]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for response in responses:
        tokens.setdefault(response.index, []).extend(response.token_ids)
    return tokens


def generate(stack: RunningStack, **request: object) -> list[text_pb2.GenerateResponse]:
    stub = stack.text_stub()
    return list(stub.Generate(text_pb2.GenerateRequest(**request), timeout=120))


def test_n4_shares_the_prompt_blocks_and_frees_them_all(stack: RunningStack) -> None:
    ids = prompt_ids(stack)
    block_size = stack.stats().block_size
    before = stack.stats()
    sampling = text_pb2.SamplingParams(n=4, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    responses = generate(stack, prompt_token_ids=ids, sampling=sampling)
    tokens = by_choice(responses)
    assert sorted(tokens) == [0, 1, 2, 3]
    assert all(len(t) == 12 for t in tokens.values())
    finishes = {r.index: r.finish_reason for r in responses if r.finish_reason}
    assert finishes == dict.fromkeys(range(4), "length")
    last = responses[-1]
    assert last.usage.prompt_tokens == len(ids)  # counted once
    assert last.usage.completion_tokens == 4 * 12
    assert all(not r.HasField("usage") for r in responses[:-1])
    after = stack.wait_all_blocks_free()
    assert after.num_free_blocks == after.num_total_blocks
    # Choices 1..3 each took every full prompt block from choice 0 and copied the partial one.
    num_full = (len(ids) - 1) // block_size
    assert after.num_forked_block_refs - before.num_forked_block_refs == 3 * num_full
    assert after.num_block_copies - before.num_block_copies == 3


def test_cancel_mid_stream_ends_every_choice_and_frees_every_block(stack: RunningStack) -> None:
    sampling = text_pb2.SamplingParams(n=4, temperature=1.0, max_new_tokens=2000, ignore_eos=True)
    call = stack.text_stub().Generate(
        text_pb2.GenerateRequest(prompt_token_ids=prompt_ids(stack), sampling=sampling),
        timeout=120,
    )
    seen: set[int] = set()
    for received, response in enumerate(call, start=1):
        seen.add(response.index)
        if received == 12:
            break
    assert len(seen) > 1  # the choices were all running
    assert stack.stats().num_running == 4
    call.cancel()
    stats = stack.wait_all_blocks_free(timeout_s=2.0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert stats.num_running == 0


def test_seeded_choices_are_reproducible_and_differ(stack: RunningStack) -> None:
    sampling = text_pb2.SamplingParams(n=3, temperature=1.0, seed=2024, max_new_tokens=16)
    runs = [by_choice(generate(stack, prompt=PROMPT, sampling=sampling)) for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0].values()}) == 3
    # Choice i is what a lone request with seed 2024 + i samples.
    for index in range(3):
        alone = text_pb2.SamplingParams(temperature=1.0, seed=2024 + index, max_new_tokens=16)
        assert by_choice(generate(stack, prompt=PROMPT, sampling=alone))[0] == runs[0][index]


def test_greedy_choices_are_identical(stack: RunningStack) -> None:
    sampling = text_pb2.SamplingParams(n=2, temperature=0.0, max_new_tokens=16)
    tokens = by_choice(generate(stack, prompt=PROMPT, sampling=sampling))
    alone = by_choice(
        generate(
            stack,
            prompt=PROMPT,
            sampling=text_pb2.SamplingParams(temperature=0.0, max_new_tokens=16),
        )
    )
    assert tokens[0] == tokens[1] == alone[0]


@pytest.mark.parametrize("n", [0, 17])
def test_n_out_of_range_is_refused_naming_n(stack: RunningStack, n: int) -> None:
    with pytest.raises(grpc.RpcError) as error:
        generate(stack, prompt="hi", sampling=text_pb2.SamplingParams(n=n))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.n" in (error.value.details() or "")
    for path, body in (
        ("/completions", {"prompt": "hi", "n": n}),
        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": n}),
    ):
        model = httpx.get(f"{stack.http}/models", timeout=10).json()["data"][0]["id"]
        response = httpx.post(f"{stack.http}{path}", json={"model": model, **body}, timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "n"
    stats = stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_openai_client_n2_streaming_and_not(stack: RunningStack) -> None:
    api = openai.OpenAI(base_url=stack.http, api_key="unused", max_retries=0, timeout=120)
    model = api.models.list().data[0].id
    messages = [{"role": "user", "content": "Name a fruit."}]
    single = api.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0,
    )
    assert single.usage is not None
    whole = api.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=10,
        temperature=0.9,
        seed=5,
        n=2,
    )
    assert [c.index for c in whole.choices] == [0, 1]
    assert all(c.message.content and c.finish_reason for c in whole.choices)
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counted once
    assert 2 <= whole.usage.completion_tokens <= 2 * 10

    chunks = list(
        api.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=10,
            temperature=0.9,
            seed=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    # Every chunk carries one choice; each choice's first chunk carries its role.
    assert all(len(chunk.choices) == 1 for chunk in chunks[:-1])
    firsts = {}
    for chunk in chunks[:-1]:
        firsts.setdefault(chunk.choices[0].index, chunk.choices[0].delta.role)
    assert firsts == {0: "assistant", 1: "assistant"}
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    # Seeded: streamed and whole give the same two answers.
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert not chunks[-1].choices and chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == single.usage.prompt_tokens
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    completions = api.completions.create(
        model=model, prompt="Once upon a time", max_tokens=8, temperature=0, n=2
    )
    assert [c.index for c in completions.choices] == [0, 1]
    assert completions.choices[0].text == completions.choices[1].text  # greedy
    streamed = list(
        api.completions.create(
            model=model, prompt="Once upon a time", max_tokens=8, temperature=0, n=2, stream=True
        )
    )
    streamed_texts = {0: "", 1: ""}
    for chunk in streamed:
        for choice in chunk.choices:
            streamed_texts[choice.index] += choice.text
    assert streamed_texts == {c.index: c.text for c in completions.choices}
    stats = stack.wait_all_blocks_free()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_a_stop_string_ends_one_choice_and_frees_its_blocks(stack: RunningStack) -> None:
    """Choice 0's text hits a stop string that choice 1's does not: choice 0 ends (the
    scheduler stops computing it) while choice 1 streams on."""
    stop = ""
    for seed in range(100, 110):
        sampling = text_pb2.SamplingParams(
            n=2, temperature=1.0, seed=seed, max_new_tokens=16, ignore_eos=True
        )
        texts: dict[int, str] = {0: "", 1: ""}
        for response in generate(stack, prompt=PROMPT, sampling=sampling):
            texts[response.index] += response.text
        candidates = [texts[0][i : i + 4] for i in range(2, len(texts[0]) - 4)]
        stop = next((c for c in candidates if c.strip() and c not in texts[1]), "")
        if stop:
            break
    assert stop, "no seed gave choice 0 a stop string choice 1 lacks"
    sampling = text_pb2.SamplingParams(
        n=2, temperature=1.0, seed=seed, max_new_tokens=1000, ignore_eos=True, stop=[stop]
    )
    call = stack.text_stub().Generate(
        text_pb2.GenerateRequest(prompt=PROMPT, sampling=sampling), timeout=120
    )
    for response in call:
        if response.index == 0 and response.finish_reason:
            assert response.finish_reason == "stop"
            break

    def choice_0_gone() -> bool:
        return stack.stats().num_running <= 1

    # Without the cancel, choice 0 would run on to 1000 tokens.
    assert wait_until(choice_0_gone, 2.0, "choice 0 ended")
    call.cancel()
    stats = stack.wait_all_blocks_free(timeout_s=2.0)
    assert stats.num_free_blocks == stats.num_total_blocks
