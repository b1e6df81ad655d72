"""The targets `llmserve bench serve` sends requests to: our gRPC API (plain or over TLS), any
OpenAI-compatible HTTP server, and an LLMEngine stepped in this process. Each records, per
request, the send time, the arrival time and token count of every streamed chunk, and the end
time. A remote target gets the run's API key (a bearer token) and trusted CAs from `Access`.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
from tqdm import tqdm  # type: ignore[import-untyped]

from benchmarks.serve_load import ClientStartError, Generation
from benchmarks.serve_metrics import Chunk, RequestRecord
from benchmarks.serve_workload import Sample
from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.common.grpc_server import CHANNEL_OPTIONS, status_for

CONNECT_TIMEOUT_S = 60.0
"""How long a gRPC client waits for its channels before the run's requests fail: a refused TLS
handshake (an untrusted certificate) is retried by gRPC for ever, never reported."""


@dataclass(frozen=True, slots=True)
class Access:
    """What a client shows the server and whom it trusts: the same for every remote target."""

    api_key: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer KEY`: an HTTP header, or gRPC metadata on every call."""
    tls_ca: Path | None = None
    """PEM bundle of the CAs trusted for https:// and grpcs://; None: the system's CA store."""

    @property
    def authorization(self) -> str | None:
        return None if self.api_key is None else f"Bearer {self.api_key}"

    def ssl_context(self) -> ssl.SSLContext:
        """For https://. ssl.SSLError (an OSError) when the --tls-ca file holds no certificate."""
        if self.tls_ca is None:
            # The system's CA store, as the standard library's clients use (httpx's own
            # default is certifi's bundle).
            return ssl.create_default_context()
        return ssl.create_default_context(cafile=str(self.tls_ca))

    def root_certificates(self) -> bytes | None:
        """For grpcs://: the --tls-ca file, else the system's CA file (None, where there is
        none, leaves gRPC its own bundled roots)."""
        if self.tls_ca is not None:
            return self.tls_ca.read_bytes()
        system = ssl.get_default_verify_paths().cafile
        return Path(system).read_bytes() if system else None


class GrpcClient:
    """Our public API, over plaintext HTTP/2 or, with `tls`, over TLS (grpcs://). One channel
    per slot up to `num_channels`: the tokenizer tier may run several replicas behind one
    SO_REUSEPORT port, and the kernel spreads *connections*, so more channels spread the load.
    Channels connect (and finish their TLS handshake) before timing, so no request's TTFT
    includes a handshake."""

    def __init__(
        self,
        address: str,
        num_channels: int,
        generation: Generation,
        *,
        tls: bool = False,
        access: Access | None = None,
    ) -> None:
        self.address = address
        self.num_channels = num_channels
        self.generation = generation
        self.tls = tls
        self.access = access or Access()
        authorization = self.access.authorization
        self.metadata = None if authorization is None else (("authorization", authorization),)
        self.channels: list[Any] = []
        self.stubs: list[Any] = []

    async def start(self) -> None:
        # gRPC shares subchannels (TCP connections) between channels with identical
        # arguments; a local pool per channel gives each its own connection.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        credentials = (
            grpc.ssl_channel_credentials(root_certificates=self.access.root_certificates())
            if self.tls
            else None
        )
        for _ in range(self.num_channels):
            if credentials is None:
                channel = grpc.aio.insecure_channel(self.address, options=options)
            else:
                channel = grpc.aio.secure_channel(self.address, credentials, options=options)
            self.channels.append(channel)
            self.stubs.append(text_pb2_grpc.TextGenerationStub(channel))
        try:
            await asyncio.wait_for(
                asyncio.gather(*(channel.channel_ready() for channel in self.channels)),
                CONNECT_TIMEOUT_S,
            )
        except TimeoutError:
            hint = " (TLS: is the server's certificate signed by --tls-ca?)" if self.tls else ""
            raise ClientStartError(
                "no connection",
                f"{self.address}: not connected after {CONNECT_TIMEOUT_S:g} s{hint}",
            ) from None

    def request_for(self, sample: Sample) -> Any:
        sampling = text_pb2.SamplingParams(
            temperature=self.generation.temperature,
            max_new_tokens=sample.output_len,
            ignore_eos=self.generation.ignore_eos,
        )
        if self.generation.num_speculative_tokens is not None:
            sampling.num_speculative_tokens = self.generation.num_speculative_tokens
        if sample.prompt_text is not None:
            return text_pb2.GenerateRequest(prompt=sample.prompt_text, sampling=sampling)
        return text_pb2.GenerateRequest(prompt_token_ids=sample.prompt_token_ids, sampling=sampling)

    async def generate(self, sample: Sample, slot: int) -> RequestRecord:
        request = self.request_for(sample)
        stub = self.stubs[slot % self.num_channels]
        record = RequestRecord(send_time_s=time.perf_counter(), prompt_tokens=sample.prompt_len)
        last = None
        try:
            async for response in stub.Generate(
                request, timeout=self.generation.timeout_s, metadata=self.metadata
            ):
                now = time.perf_counter()
                if response.token_ids:
                    record.chunks.append(Chunk(now, len(response.token_ids)))
                last = response
        except grpc.aio.AioRpcError as exc:
            record.error = exc.code().name
        record.end_time_s = time.perf_counter()
        record.output_tokens = sum(chunk.num_tokens for chunk in record.chunks)
        if last is not None and last.finish_reason:
            if last.usage.prompt_tokens:
                record.prompt_tokens = last.usage.prompt_tokens
            record.cached_prompt_tokens = last.usage.cached_prompt_tokens
            if last.finish_reason not in ("stop", "length"):
                record.error = record.error or last.finish_reason
        elif record.error is None:
            record.error = "no finish_reason"
        return record

    async def close(self) -> None:
        await asyncio.gather(*(channel.close() for channel in self.channels))


class OpenAIClient:
    """Any OpenAI-compatible server: POST {base}/completions with stream=true and
    stream_options.include_usage over httpx, one HTTP/1.1 connection per request
    (`Connection: close`, as a fresh client would open), SSE parsed here. With an API key,
    every request (GET /models too) carries `Authorization: Bearer KEY`.

    What is timed, per request:
    - send: just before the request is written, so TTFT holds the TCP connect and, on https,
      the TLS handshake (the gRPC client connects before timing: its TTFT holds neither);
    - TTFT: send to the first SSE event whose choice carries text (or logprobs tokens); an
      event with empty text (a role-only first chunk) is no token;
    - end: when the stream ends ([DONE], after the usage event).
    Streamed text does not say how many tokens an event holds, and a server may merge several
    tokens into one event (ours does for a client that reads slower than the engine writes):
    an event counts as len(logprobs.tokens) when the server sends logprobs, else as one token.
    The output count is the server's usage.completion_tokens when it reports usage, else the
    number of events. So TPOT, (E2E - TTFT) / (output tokens - 1), stays exact under merging,
    while ITL is per event: one gap for the k tokens a merged event carries."""

    def __init__(
        self,
        base_url: str,
        model: str | None,
        generation: Generation,
        access: Access | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http(s)://host:port/v1, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.base_path = parts.path.rstrip("/")
        self.model = model
        self.generation = generation
        self.access = access or Access()
        self.http: httpx.AsyncClient | None = None

    async def start(self) -> None:
        # No httpx timeout and no pool limit: the per-request deadline is --timeout-s (an
        # asyncio timeout around the whole stream), and a pool cap would queue requests
        # inside the client, where their wait would count as the server's TTFT.
        headers = {"Accept": "text/event-stream, application/json", "Connection": "close"}
        if self.access.authorization is not None:
            headers["Authorization"] = self.access.authorization
        self.http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=None,
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            verify=self.access.ssl_context(),
        )
        if self.model is None:
            self.model = await self.first_model()

    async def first_model(self) -> str:
        """The first model GET /models lists: the model name when --model is not given."""
        assert self.http is not None
        where = f"no --model given and GET {self.base_path}/models"
        try:
            response = await self.http.get("/models")
            models = response.json().get("data", []) if response.status_code == 200 else []
        except (httpx.HTTPError, OSError, ValueError) as exc:
            raise ClientStartError(type(exc).__name__, f"{where} failed: {exc!r}") from None
        if response.status_code != 200:
            status = f"HTTP {response.status_code}"
            raise ClientStartError(status, f"{where} answered {status}")
        if not models:
            raise ClientStartError("no model", f"{where} listed no model")
        return str(models[0]["id"])

    async def close(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    def payload(self, sample: Sample) -> dict[str, Any]:
        prompt: str | list[int] = (
            sample.prompt_text if sample.prompt_text is not None else list(sample.prompt_token_ids)
        )
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": sample.output_len,
            "temperature": self.generation.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.generation.ignore_eos:
            # Extensions, ignored by servers that lack them: ignore_eos (vLLM, SGLang,
            # llama.cpp's own server), min_tokens (vLLM, SGLang, llama-cpp-python).
            payload["ignore_eos"] = True
            payload["min_tokens"] = sample.output_len
        if self.generation.num_speculative_tokens is not None:
            payload["num_speculative_tokens"] = self.generation.num_speculative_tokens
        return payload

    async def generate(self, sample: Sample, slot: int) -> RequestRecord:
        assert self.http is not None, "start() first"
        body = json.dumps(self.payload(sample)).encode("utf-8")
        record = RequestRecord(send_time_s=time.perf_counter(), prompt_tokens=sample.prompt_len)
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        try:
            async with (
                asyncio.timeout(self.generation.timeout_s),
                self.http.stream(
                    "POST",
                    "/completions",
                    content=body,
                    headers={"Content-Type": "application/json"},
                ) as response,
            ):
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}"
                else:
                    async for data in sse_events(response.aiter_lines()):
                        if data == "[DONE]":
                            break
                        now = time.perf_counter()
                        message = json.loads(data)
                        if message.get("error"):
                            record.error = "stream error"
                            break
                        usage = message.get("usage") or usage
                        for choice in message.get("choices") or []:
                            num_tokens = chunk_tokens(choice)
                            if num_tokens:
                                record.chunks.append(Chunk(now, num_tokens))
                            finish_reason = choice.get("finish_reason") or finish_reason
        except TimeoutError:
            record.error = "timeout"
        # httpx.HTTPError: refused, reset or cut-short connections; ValueError: bad JSON.
        except (httpx.HTTPError, OSError, ValueError) as exc:
            record.error = type(exc).__name__
        record.end_time_s = time.perf_counter()
        record.output_tokens = sum(chunk.num_tokens for chunk in record.chunks)
        if usage:
            record.output_tokens = int(usage.get("completion_tokens", record.output_tokens))
            record.prompt_tokens = int(usage.get("prompt_tokens", record.prompt_tokens))
            details = usage.get("prompt_tokens_details") or {}
            record.cached_prompt_tokens = int(details.get("cached_tokens") or 0)
        if record.error is None and finish_reason is None:
            record.error = "no finish_reason"
        return record


def chunk_tokens(choice: dict[str, Any]) -> int:
    logprobs = choice.get("logprobs")
    if isinstance(logprobs, dict) and isinstance(logprobs.get("tokens"), list):
        return len(logprobs["tokens"])
    return 1 if choice.get("text") else 0


async def sse_events(lines: AsyncIterator[str]) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined by newlines), from the
    body's lines (line ends optional)."""
    data: list[str] = []
    async for raw in lines:
        line = raw.rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        field, _, value = line.partition(":")
        if field == "data":
            data.append(value.removeprefix(" "))
    if data:
        yield "\n".join(data)


# ---- in-process engine ----------------------------------------------------------------------


class InProcessTarget:
    """An LLMEngine stepped in this thread. Tokens 'arrive' when the step that made them
    returns; requests are added between steps (see `run` for their send time)."""

    def __init__(self, engine: Any, generation: Generation) -> None:
        self.engine = engine
        self.generation = generation
        self.description = f"inprocess ({engine.model_name}, {engine.dtype})"

    def run(
        self,
        samples: Sequence[Sample],
        offsets: Sequence[float],
        concurrency: int | None,
        progress: tqdm | None,
    ) -> list[RequestRecord]:
        from services.contracts.errors import LLMServeError
        from services.contracts.sampling_params import SamplingParams

        engine = self.engine
        records: list[RequestRecord] = []
        running: dict[str, RequestRecord] = {}
        start = time.perf_counter()
        slot_freed_at = start  # last time a finish made room under a full concurrency cap
        while len(records) < len(samples) or engine.has_unfinished_requests():
            now = time.perf_counter()
            while (
                len(records) < len(samples)
                and start + offsets[len(records)] <= now
                and (concurrency is None or len(running) < concurrency)
            ):
                sample = samples[len(records)]
                # A request due while a step ran is 'sent' when it was due, as a server would
                # have queued it then; one held back by the concurrency cap when a slot freed.
                record = RequestRecord(max(start + offsets[len(records)], slot_freed_at))
                records.append(record)
                prompt = (
                    sample.prompt_token_ids
                    if sample.prompt_text is None
                    else engine.tokenizer.encode(sample.prompt_text)
                )
                record.prompt_tokens = len(prompt)
                sampling = SamplingParams(
                    temperature=self.generation.temperature,
                    max_new_tokens=sample.output_len,
                    ignore_eos=self.generation.ignore_eos,
                )
                try:
                    running[engine.add_request(prompt, sampling)] = record
                except LLMServeError as exc:
                    record.error = status_for(exc)[0].name
                    record.end_time_s = time.perf_counter()
                    if progress is not None:
                        progress.update()
            if not engine.has_unfinished_requests():
                if len(records) < len(samples):
                    time.sleep(max(0.0, start + offsets[len(records)] - time.perf_counter()))
                continue
            events = engine.step()
            now = time.perf_counter()
            for event in events:
                record = running[event.request_id]
                if event.new_token_ids:
                    record.chunks.append(Chunk(now, len(event.new_token_ids)))
                if event.finished:
                    if len(running) == concurrency:
                        slot_freed_at = now
                    del running[event.request_id]
                    record.end_time_s = now
                    record.output_tokens = sum(chunk.num_tokens for chunk in record.chunks)
                    if event.finish_reason not in ("stop", "length"):
                        record.error = str(event.finish_reason)
                    if progress is not None:
                        progress.update()
        return records

    def close(self) -> None:
        pass
