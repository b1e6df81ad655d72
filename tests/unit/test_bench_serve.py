"""`llmserve bench serve` without a model: seeded workloads, Poisson arrivals, and each client
(OpenAI SSE, gRPC, in-process) against a fake server on loopback or a fake engine."""

from __future__ import annotations

import asyncio
import json
import math
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest

from benchmarks.serve_clients import GrpcClient, InProcessTarget, OpenAIClient, sse_events
from benchmarks.serve_load import Generation, Load, drive, run_point
from benchmarks.serve_metrics import Slo
from benchmarks.serve_workload import (
    Sample,
    arrival_offsets,
    draw_lengths,
    lengths_file,
    shared_prefix,
    sharegpt,
    synthetic,
    synthetic_lengths,
    synthetic_of_lengths,
    synthetic_text,
)
from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.contracts.step import FinishReason, TokenEvent

# ---- workloads ------------------------------------------------------------------------------


def test_synthetic_prompts_have_exact_lengths_and_follow_the_seed() -> None:
    samples = synthetic(4, 32, 16, seed=3)
    assert [s.prompt_len for s in samples] == [32] * 4
    assert {s.output_len for s in samples} == {16}
    assert samples == synthetic(4, 32, 16, seed=3)
    assert samples != synthetic(4, 32, 16, seed=4)


def test_shared_prefix_shares_the_system_prompt_not_the_suffix() -> None:
    samples = shared_prefix(6, prefix_len=64, suffix_len=8, output_len=4, seed=0, num_prefixes=2)
    assert all(s.prompt_len == 72 for s in samples)
    prefixes = [s.prompt_token_ids[:64] for s in samples]
    assert prefixes[0] == prefixes[2] == prefixes[4] != prefixes[1] == prefixes[3]
    assert len({s.prompt_token_ids[64:] for s in samples}) == 6


def test_arrivals_all_at_once_for_an_infinite_rate() -> None:
    assert arrival_offsets(3, math.inf, seed=0) == [0.0, 0.0, 0.0]


def test_poisson_arrivals_have_the_requested_mean_gap() -> None:
    offsets = arrival_offsets(4000, 10.0, seed=0)
    assert offsets[0] == 0.0
    assert offsets == sorted(offsets)
    assert offsets[-1] / (len(offsets) - 1) == pytest.approx(0.1, rel=0.05)
    assert offsets == arrival_offsets(4000, 10.0, seed=0)


def test_arrival_rate_must_be_positive() -> None:
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(1, 0.0, seed=0)


def test_sharegpt_takes_the_first_human_turn_and_its_reply_length(tmp_path: Path) -> None:
    words = " ".join(["w"] * 6)
    data = [
        {"conversations": [{"from": "gpt", "value": "hi"}]},  # no human turn: skipped
        {"conversations": [{"from": "human", "value": "a b"}, {"from": "gpt", "value": words}]},
        {
            "conversations": [
                {"from": "system", "value": "be brief"},
                {"from": "human", "value": words},
                {"from": "gpt", "value": words + " w w"},
                {"from": "human", "value": "later turn"},
            ]
        },
    ]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    (sample,) = sharegpt(path, 1, lambda text: len(text.split()), seed=0)
    # The 2-word prompt is too short (< 4 tokens), so only the third conversation qualifies.
    assert sample.prompt_text == words
    assert sample.prompt_len == 6
    assert sample.output_len == 8
    with pytest.raises(ValueError, match="only 1 usable"):
        sharegpt(path, 2, lambda text: len(text.split()), seed=0)


# ---- SSE parsing ----------------------------------------------------------------------------


async def _lines(*lines: bytes) -> AsyncIterator[str]:
    for line in lines:
        yield line.decode()


def test_sse_events_join_multiline_data_and_skip_comments() -> None:
    async def collect() -> list[str]:
        lines = _lines(b": ping\r\n", b"data: a\r\n", b"data: b\r\n", b"\r\n", b"data:c\n", b"\n")
        return [event async for event in sse_events(lines)]

    assert asyncio.run(collect()) == ["a\nb", "c"]


def test_chunked_body_lines_reassemble_lines_split_across_chunks() -> None:
    # The lines the OpenAI client feeds to sse_events, from a body whose chunks split lines.
    chunked = b"5\r\ndata:\r\n6\r\n 1\n\nda\r\n6\r\nta: 2\n\r\n0\r\n\r\n"

    async def respond(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked)
        await writer.drain()
        writer.close()

    async def collect() -> list[str]:
        server = await asyncio.start_server(respond, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with (
            server,
            httpx.AsyncClient() as http,
            http.stream("GET", f"http://127.0.0.1:{port}/") as response,
        ):
            return [line async for line in response.aiter_lines()]

    assert asyncio.run(collect()) == ["data: 1", "", "data: 2"]


# ---- OpenAI-compatible HTTP against a fake server --------------------------------------------


class FakeOpenAIHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    bodies: list[dict[str, Any]] = []  # noqa: RUF012 (shared by the test on purpose)

    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        body = json.dumps({"data": [{"id": "fake-model"}]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.bodies.append(request)
        if request["max_tokens"] > 100:
            self.send_response(400)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = request["max_tokens"]
        events = [{"choices": [{"text": f"t{i}", "finish_reason": None}]} for i in range(n - 1)]
        events.append({"choices": [{"text": "end", "finish_reason": "length"}]})
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": n,
            "prompt_tokens_details": {"cached_tokens": 2},  # llama-server's field
        }
        events.append({"choices": [], "usage": usage})
        for event in [*(json.dumps(e) for e in events), "[DONE]"]:
            data = f"data: {event}\n\n".encode()
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


@pytest.fixture
def openai_url() -> Iterator[str]:
    FakeOpenAIHandler.bodies = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAIHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_openai_client_streams_and_records_every_chunk(openai_url: str) -> None:
    samples = [Sample((101, 102, 103), 5), Sample((104,), 3), Sample((105,), 500)]

    async def main() -> list[Any]:
        client = OpenAIClient(openai_url, None, Generation())
        await client.start()
        return await drive(client, samples, [0.0] * 3, concurrency=2, progress=None)

    first, second, failed = asyncio.run(main())
    assert first.ok and second.ok
    assert [c.num_tokens for c in first.chunks] == [1] * 5
    assert first.output_tokens == 5
    assert first.prompt_tokens == 7  # the server's usage wins over the local count
    assert first.cached_prompt_tokens == 2
    assert first.send_time_s < first.chunks[0].time_s <= first.end_time_s
    assert failed.error == "HTTP 400"
    body = FakeOpenAIHandler.bodies[0]
    assert body["model"] == "fake-model"
    assert body["stream"] is True
    assert body["ignore_eos"] is True
    # llama-server reads max_tokens as n_predict; requests race, so compare them unordered.
    assert sorted(b["max_tokens"] for b in FakeOpenAIHandler.bodies) == [3, 5, 500]
    assert sorted(tuple(b["prompt"]) for b in FakeOpenAIHandler.bodies)[:2] == [
        (101, 102, 103),
        (104,),
    ]


# ---- gRPC against a fake TextGeneration servicer --------------------------------------------


class FakeTextGeneration(text_pb2_grpc.TextGenerationServicer):  # type: ignore[misc]
    """Streams max_new_tokens tokens, two per message; prompts of length 1 are refused."""

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[Any]:
        if len(request.prompt_token_ids) == 1:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full")
        n = request.sampling.max_new_tokens
        for start in range(0, n, 2):
            await asyncio.sleep(0.001)
            yield text_pb2.GenerateResponse(token_ids=list(range(start, min(start + 2, n))))
        yield text_pb2.GenerateResponse(
            finish_reason="length",
            usage=text_pb2.Usage(prompt_tokens=len(request.prompt_token_ids)),
        )


def test_grpc_client_counts_tokens_per_message_and_maps_status_codes() -> None:
    samples = [Sample((1, 2, 3), 5), Sample((4,), 5), Sample((5, 6), 2)]

    async def main() -> list[Any]:
        server = grpc.aio.server()
        text_pb2_grpc.add_TextGenerationServicer_to_server(FakeTextGeneration(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        client = GrpcClient(f"127.0.0.1:{port}", 2, Generation())
        await client.start()
        try:
            return await drive(client, samples, [0.0] * 3, concurrency=3, progress=None)
        finally:
            await client.close()
            await server.stop(None)

    ok, refused, short = asyncio.run(main())
    assert [c.num_tokens for c in ok.chunks] == [2, 2, 1]
    assert ok.output_tokens == 5
    assert ok.prompt_tokens == 3
    assert ok.ok
    assert refused.error == "RESOURCE_EXHAUSTED"
    assert short.output_tokens == 2 and short.tpot_s is not None


# ---- in-process target with a fake engine ----------------------------------------------------


@dataclass
class FakeEngine:
    """One token per running request per step; records the most requests ever in flight."""

    model_name: str = "fake"
    dtype: str = "none"
    remaining: dict[str, int] = field(default_factory=dict)
    max_in_flight: int = 0

    def add_request(self, prompt: Any, sampling: Any) -> str:
        request_id = f"r{len(self.remaining)}-{id(prompt)}"
        self.remaining[request_id] = sampling.max_new_tokens
        self.max_in_flight = max(self.max_in_flight, sum(n > 0 for n in self.remaining.values()))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return any(n > 0 for n in self.remaining.values())

    def step(self) -> list[TokenEvent]:
        events = []
        for request_id, n in self.remaining.items():
            if n > 0:
                self.remaining[request_id] = n - 1
                done = FinishReason.LENGTH if n == 1 else None
                events.append(TokenEvent(request_id, [7], finish_reason=done))
        return events


def test_inprocess_target_respects_the_concurrency_cap() -> None:
    engine = FakeEngine()
    target = InProcessTarget(engine, Generation())
    samples = synthetic(6, 4, 3, seed=0)
    summary, records = run_point(
        target, samples, Load(concurrency=2), Slo(ttft_ms=1e6), show_progress=False
    )
    assert engine.max_in_flight == 2
    assert summary.num_completed == 6
    assert all(r.output_tokens == 3 and len(r.chunks) == 3 for r in records)
    assert summary.output_tokens == 18
    assert summary.goodput_requests_per_s == pytest.approx(summary.requests_per_s)


def test_synthetic_text_prompts_re_encode_to_the_input_length() -> None:
    # A toy tokenizer whose decode -> encode is not the identity: ids above 20000 decode to a
    # number that encodes as two tokens, like neighbouring BPE pieces that merge or split.
    def decode(ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    def encode(text: str) -> list[int]:
        ids: list[int] = []
        for word in text.split():
            value = int(word)
            ids += [value // 2, value - value // 2] if value > 20000 else [value]
        return ids

    samples = synthetic_text([(12, 3)] * 5, seed=1, encode=encode, decode=decode)
    assert all(s.prompt_text is not None for s in samples)
    assert [len(encode(s.prompt_text or "")) for s in samples] == [12] * 5
    assert [s.prompt_len for s in samples] == [12] * 5
    assert {s.output_len for s in samples} == {3}
    assert samples == synthetic_text([(12, 3)] * 5, seed=1, encode=encode, decode=decode)


def test_fixed_lengths_give_the_same_prompts_as_the_plain_synthetic_set() -> None:
    lengths = synthetic_lengths(4, 32, 16, seed=3)
    assert lengths == [(32, 16)] * 4
    assert synthetic_of_lengths(lengths, seed=3) == synthetic(4, 32, 16, seed=3)


def test_uniform_lengths_stay_in_range_and_average_to_the_mean() -> None:
    import random

    lengths = draw_lengths(4000, 100, "uniform", 0.5, random.Random(0))
    assert min(lengths) >= 50 and max(lengths) <= 150
    assert sum(lengths) / len(lengths) == pytest.approx(100, rel=0.03)
    assert len(set(lengths)) > 50


def test_normal_lengths_have_the_requested_spread_and_stay_positive() -> None:
    import random
    import statistics

    lengths = draw_lengths(4000, 200, "normal", 0.2, random.Random(0))
    assert statistics.mean(lengths) == pytest.approx(200, rel=0.03)
    assert statistics.pstdev(lengths) == pytest.approx(40, rel=0.1)
    assert min(draw_lengths(2000, 10, "normal", 2.0, random.Random(1))) >= 1
    with pytest.raises(ValueError, match="distribution"):
        draw_lengths(1, 10, "zipf", 0.1, random.Random(0))


def test_lengths_file_accepts_csv_and_json_and_cycles(tmp_path: Path) -> None:
    csv_path = tmp_path / "lengths.csv"
    csv_path.write_text("input_len,output_len\n10,5\n20,7\n")
    assert lengths_file(csv_path, 3) == [(10, 5), (20, 7), (10, 5)]
    json_path = tmp_path / "lengths.json"
    json_path.write_text(json.dumps([[4, 2], {"input_len": 8, "output_len": 3}]))
    assert lengths_file(json_path, 2) == [(4, 2), (8, 3)]
    samples = synthetic_of_lengths(lengths_file(json_path, 2), seed=0)
    assert [(s.prompt_len, s.output_len) for s in samples] == [(4, 2), (8, 3)]
    json_path.write_text("[]")
    with pytest.raises(ValueError, match="no \\(input_len"):
        lengths_file(json_path, 1)
