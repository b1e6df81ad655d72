"""Serving benchmark: a load generator that streams requests to a target and reports TTFT,
TPOT, ITL, end-to-end latency, throughput and goodput (see serve_metrics.py).

llmserve bench serve --target grpc://127.0.0.1:50051 --num-prompts 64 --concurrency 8
llmserve bench serve --target http://127.0.0.1:8000/v1 --request-rate 4 --dataset sharegpt:F
llmserve bench serve --target inprocess --dtype bfloat16 --input-len 128 --output-len 64
llmserve bench serve --request-rate 1,2,4,inf --concurrency 32 --plot-out curve.png
llmserve bench serve --concurrency 1,8,32,64 --json-out sweep.json
llmserve bench serve --sweep --concurrency 64   # saturate, then 25/50/75/90% of that rate

Targets: `grpc://host:port` is our public API (TextGeneration.Generate);
`http://host:port/v1` is any OpenAI-compatible server (streaming /v1/completions, SSE parsed
with the standard library); `inprocess` is an LLMEngine in this process, stepped here. All
three record the same thing: send time, arrival time and token count of each streamed chunk,
end time. Load is either a fixed number of requests in flight (--concurrency) or Poisson
arrivals (--request-rate), or both (arrivals capped by the concurrency). Comma lists of rates
or concurrencies run a sweep, one point per load, each with fresh prompts; --plot-out draws
TTFT and TPOT against achieved throughput across the points (serve_plot.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import ssl
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlsplit

import grpc
from tqdm import tqdm  # type: ignore[import-untyped]

from protos.llmserve.v1 import text_pb2, text_pb2_grpc
from services.bench.common import command_line, cpu_model_name, format_table, load_average
from services.bench.serve_metrics import (
    LATENCY_HEADERS,
    THROUGHPUT_HEADERS,
    Chunk,
    RequestRecord,
    ServeSummary,
    Slo,
    latency_rows,
    summarize,
    throughput_row,
)
from services.bench.serve_plot import (
    PlotUnavailableError,
    plot_latency_vs_throughput,
    require_matplotlib,
)
from services.bench.serve_workload import (
    LENGTH_DISTRIBUTIONS,
    Sample,
    arrival_offsets,
    lengths_file,
    shared_prefix,
    sharegpt,
    synthetic_lengths,
    synthetic_of_lengths,
    synthetic_text,
)
from services.bench.sweep import (
    SATURATION_FRACTIONS,
    SWEEP_HEADERS,
    PointResult,
    SweepPoint,
    curve_points,
    in_load_order,
    parse_concurrencies,
    parse_rates,
    point_seed,
    saturation_rates,
    sweep_points,
    sweep_rows,
)
from services.common.grpc_server import CHANNEL_OPTIONS, install_uvloop, status_for

MAX_DEFAULT_CHANNELS = 8
WARMUP_SEED_OFFSET = 7919  # warm-up prompts differ from the timed ones: no prefix-cache hits


@dataclass(frozen=True, slots=True)
class Load:
    """How requests are offered: Poisson arrivals at `request_rate` (inf = all at once), at
    most `concurrency` in flight (None = no cap)."""

    request_rate: float = math.inf
    concurrency: int | None = None
    seed: int = 0

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate} req/s"
        cap = f"concurrency {self.concurrency}" if self.concurrency else "no concurrency cap"
        return f"arrivals: {rate} (Poisson, seed {self.seed}); {cap}"


@dataclass(frozen=True, slots=True)
class Generation:
    """Per-request generation settings, the same for every target."""

    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float | None = None


class Target(Protocol):
    """Where requests go. `run` sends every sample at its offset and returns one record per
    sample, in sample order."""

    description: str

    def run(
        self,
        samples: Sequence[Sample],
        offsets: Sequence[float],
        concurrency: int | None,
        progress: tqdm | None,
    ) -> list[RequestRecord]: ...

    def close(self) -> None: ...


# ---- asyncio clients (gRPC and OpenAI HTTP) -------------------------------------------------


class StreamingClient(Protocol):
    async def start(self) -> None: ...

    async def generate(self, sample: Sample, slot: int) -> RequestRecord: ...

    async def close(self) -> None: ...


async def drive(
    client: StreamingClient,
    samples: Sequence[Sample],
    offsets: Sequence[float],
    concurrency: int | None,
    progress: tqdm | None,
) -> list[RequestRecord]:
    """Send sample i at `offsets[i]` seconds after the start, once one of `concurrency` slots
    is free. The slot number picks the client's channel, so each slot keeps its connection."""
    slots: asyncio.Queue[int] = asyncio.Queue()
    for slot in range(concurrency or len(samples)):
        slots.put_nowait(slot)
    start = time.perf_counter()

    async def one(index: int, sample: Sample) -> RequestRecord:
        delay = start + offsets[index] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        slot = await slots.get()
        try:
            return await client.generate(sample, slot)
        finally:
            slots.put_nowait(slot)
            if progress is not None:
                progress.update()

    return list(await asyncio.gather(*(one(i, s) for i, s in enumerate(samples))))


class AsyncTarget:
    """A target reached through an asyncio client; each run gets a fresh event loop."""

    def __init__(self, description: str, make_client: Any) -> None:
        self.description = description
        self.make_client = make_client

    def run(
        self,
        samples: Sequence[Sample],
        offsets: Sequence[float],
        concurrency: int | None,
        progress: tqdm | None,
    ) -> list[RequestRecord]:
        install_uvloop()

        async def main() -> list[RequestRecord]:
            client: StreamingClient = self.make_client()
            await client.start()
            try:
                return await drive(client, samples, offsets, concurrency, progress)
            finally:
                await client.close()

        return asyncio.run(main())

    def close(self) -> None:
        pass


class GrpcClient:
    """Our public API. One channel per slot up to `num_channels`: the tokenizer tier may run
    several replicas behind one SO_REUSEPORT port, and the kernel spreads *connections*, so
    more channels spread the load."""

    def __init__(self, address: str, num_channels: int, generation: Generation) -> None:
        self.address = address
        self.num_channels = num_channels
        self.generation = generation
        self.channels: list[Any] = []
        self.stubs: list[Any] = []

    async def start(self) -> None:
        # gRPC shares subchannels (TCP connections) between channels with identical
        # arguments; a local pool per channel gives each its own connection.
        options = [*CHANNEL_OPTIONS, ("grpc.use_local_subchannel_pool", 1)]
        for _ in range(self.num_channels):
            channel = grpc.aio.insecure_channel(self.address, options=options)
            self.channels.append(channel)
            self.stubs.append(text_pb2_grpc.TextGenerationStub(channel))
        # Connect before timing, so no request's TTFT includes a TCP/HTTP2 handshake.
        await asyncio.gather(*(channel.channel_ready() for channel in self.channels))

    def request_for(self, sample: Sample) -> Any:
        sampling = text_pb2.SamplingParams(
            temperature=self.generation.temperature,
            max_new_tokens=sample.output_len,
            ignore_eos=self.generation.ignore_eos,
        )
        if sample.prompt_text is not None:
            return text_pb2.GenerateRequest(prompt=sample.prompt_text, sampling=sampling)
        return text_pb2.GenerateRequest(prompt_token_ids=sample.prompt_token_ids, sampling=sampling)

    async def generate(self, sample: Sample, slot: int) -> RequestRecord:
        request = self.request_for(sample)
        stub = self.stubs[slot % self.num_channels]
        record = RequestRecord(send_time_s=time.perf_counter(), prompt_tokens=sample.prompt_len)
        last = None
        try:
            async for response in stub.Generate(request, timeout=self.generation.timeout_s):
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
    """Any OpenAI-compatible server: POST {base}/completions with stream=true, one HTTP/1.1
    connection per request, SSE parsed here. Streamed text does not say how many tokens a
    chunk holds: a chunk counts as len(logprobs.tokens) when the server sends logprobs, else
    as one token; the output count is the server's usage.completion_tokens when it reports
    usage (stream_options.include_usage), else the number of chunks."""

    def __init__(self, base_url: str, model: str | None, generation: Generation) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"expected http(s)://host:port/v1, got {base_url!r}")
        self.host = parts.hostname
        self.tls = parts.scheme == "https"
        self.port = parts.port or (443 if self.tls else 80)
        self.base_path = parts.path.rstrip("/")
        self.model = model
        self.generation = generation

    async def start(self) -> None:
        if self.model is None:
            status, body = await self._request("GET", f"{self.base_path}/models", None)
            models = json.loads(body).get("data", []) if status == 200 else []
            if not models:
                raise ValueError(f"no --model given and GET {self.base_path}/models failed")
            self.model = str(models[0]["id"])

    async def close(self) -> None:
        pass

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
        return payload

    async def _open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        context = ssl.create_default_context() if self.tls else None
        return await asyncio.open_connection(self.host, self.port, ssl=context)

    def _head(self, method: str, path: str, body: bytes) -> bytes:
        lines = [
            f"{method} {path} HTTP/1.1",
            f"Host: {self.host}:{self.port}",
            "Accept: text/event-stream, application/json",
            "Content-Type: application/json",
            f"Content-Length: {len(body)}",
            "Connection: close",
        ]
        return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body

    async def _request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        """A whole (non-streaming) request: status and body."""
        reader, writer = await self._open()
        try:
            writer.write(self._head(method, path, body or b""))
            await writer.drain()
            status, chunked = await read_http_head(reader)
            data = b"".join([line async for line in body_lines(reader, chunked)])
            return status, data
        finally:
            writer.close()

    async def generate(self, sample: Sample, slot: int) -> RequestRecord:
        body = json.dumps(self.payload(sample)).encode("utf-8")
        record = RequestRecord(send_time_s=time.perf_counter(), prompt_tokens=sample.prompt_len)
        usage: dict[str, Any] | None = None
        finish_reason: str | None = None
        writer = None
        try:
            async with asyncio.timeout(self.generation.timeout_s):
                reader, writer = await self._open()
                writer.write(self._head("POST", f"{self.base_path}/completions", body))
                await writer.drain()
                status, chunked = await read_http_head(reader)
                if status != 200:
                    record.error = f"HTTP {status}"
                else:
                    async for data in sse_events(body_lines(reader, chunked)):
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
        except (OSError, ValueError, EOFError) as exc:  # EOFError: the stream was cut short
            record.error = type(exc).__name__
        finally:
            if writer is not None:
                writer.close()
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


async def read_http_head(reader: asyncio.StreamReader) -> tuple[int, bool]:
    """Status code and whether the body is chunked."""
    status_line = await reader.readline()
    parts = status_line.decode("latin-1").split(None, 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/"):
        raise ValueError(f"not an HTTP response: {status_line[:80]!r}")
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b"\n", b""):
            break
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    return int(parts[1]), chunked


async def body_lines(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body's lines (with their line ends), de-chunked; ends at EOF or the last chunk."""
    if not chunked:
        while line := await reader.readline():
            yield line
        return
    pending = b""
    while True:
        size_line = await reader.readline()
        if not size_line:
            break
        size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
        if size == 0:
            break
        pending += await reader.readexactly(size)
        await reader.readexactly(2)  # CRLF after the chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
    if pending:
        yield pending


async def sse_events(lines: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The data of each server-sent event (multi-line data joined by newlines)."""
    data: list[str] = []
    async for raw in lines:
        line = raw.decode("utf-8").rstrip("\r\n")
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
        from services.common.errors import LLMServeError
        from services.common.sampling_params import SamplingParams

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


# ---- one benchmark point --------------------------------------------------------------------


def run_point(
    target: Target,
    samples: Sequence[Sample],
    load: Load,
    slo: Slo,
    warmup_samples: Sequence[Sample] = (),
    show_progress: bool = True,
    description: str = "requests",
) -> tuple[ServeSummary, list[RequestRecord]]:
    """Warm up (untimed, all at once under the concurrency cap), then offer `samples` under
    `load`. The unit a request-rate sweep repeats, one call per rate."""
    if warmup_samples:
        target.run(warmup_samples, [0.0] * len(warmup_samples), load.concurrency, None)
    offsets = arrival_offsets(len(samples), load.request_rate, load.seed)
    progress = tqdm(
        total=len(samples), desc=description, file=sys.stderr, disable=not show_progress
    )
    try:
        records = target.run(samples, offsets, load.concurrency, progress)
    finally:
        progress.close()
    return summarize(records, slo), records


def report(summary: ServeSummary) -> str:
    lines = [
        format_table(LATENCY_HEADERS, latency_rows(summary)),
        "",
        format_table(THROUGHPUT_HEADERS, [throughput_row(summary)]),
    ]
    if summary.slo.is_set:
        lines.append(
            f"\ngoodput SLO: TTFT <= {summary.slo.ttft_ms} ms, TPOT <= {summary.slo.tpot_ms} ms"
        )
    if summary.errors:
        listed = ", ".join(f"{status}: {count}" for status, count in summary.errors.items())
        lines.append(f"\nerrors by status: {listed}")
    return "\n".join(lines)


# ---- command line ---------------------------------------------------------------------------


def build_samples(args: argparse.Namespace, num_prompts: int, seed: int) -> list[Sample]:
    dataset: str = args.dataset
    if dataset == "synthetic":
        return synthetic_of_lengths(workload_lengths(args, num_prompts, seed), seed)
    if dataset == "synthetic-text":
        tokenizer = _tokenizer(args)
        return synthetic_text(
            workload_lengths(args, num_prompts, seed),
            seed,
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            tokenizer.decode,
        )
    if dataset == "shared-prefix":
        return shared_prefix(
            num_prompts,
            args.prefix_len,
            args.input_len,
            args.output_len,
            seed,
            num_prefixes=args.num_prefixes,
        )
    if dataset.startswith("sharegpt:"):
        tokenizer = _tokenizer(args)
        return sharegpt(
            Path(dataset.removeprefix("sharegpt:")),
            num_prompts,
            lambda text: len(tokenizer.encode(text, add_special_tokens=False)),
            seed,
            output_len=args.sharegpt_output_len,
        )
    raise ValueError(
        f"--dataset is synthetic, synthetic-text, shared-prefix or sharegpt:FILE; got {dataset!r}"
    )


def workload_lengths(
    args: argparse.Namespace, num_prompts: int, seed: int
) -> list[tuple[int, int]]:
    """(prompt, output) lengths of the synthetic datasets."""
    if args.lengths_file:
        return lengths_file(Path(args.lengths_file), num_prompts)
    return synthetic_lengths(
        num_prompts, args.input_len, args.output_len, seed, args.length_dist, args.length_spread
    )


_TOKENIZERS: dict[str | None, Any] = {}


def _tokenizer(args: argparse.Namespace) -> Any:
    """The --tokenizer model's tokenizer, loaded once (every sweep point builds prompts)."""
    if args.tokenizer not in _TOKENIZERS:
        from services.common.model_source import resolve_model_path
        from services.common.model_tokenizer import ModelTokenizer

        _TOKENIZERS[args.tokenizer] = ModelTokenizer.from_path(resolve_model_path(args.tokenizer))
    return _TOKENIZERS[args.tokenizer]


def make_target(args: argparse.Namespace, generation: Generation) -> Target:
    target: str = args.target
    if target == "inprocess":
        from services.engine.config import EngineConfig
        from services.engine.engine import LLMEngine
        from services.worker.config import GiB

        config = EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_bytes=int(args.kv_cache_gib * GiB),
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            num_threads=args.threads,
            enforce_eager=args.enforce_eager,
            seed=0,
        )
        # Without --quantization the engine's own default applies.
        if args.quantization is not None:
            config = replace(config, quantization=args.quantization)
        engine = LLMEngine(config)
        return InProcessTarget(engine, generation)
    if target.startswith("grpc://"):
        address = target.removeprefix("grpc://")
        most_in_flight = max(args.concurrency) if args.concurrency else args.num_prompts
        channels = args.channels or min(most_in_flight, MAX_DEFAULT_CHANNELS)
        return AsyncTarget(
            f"{target} ({channels} channels)",
            lambda: GrpcClient(address, channels, generation),
        )
    if target.startswith(("http://", "https://")):
        OpenAIClient(target, args.model, generation)  # validate the URL now
        return AsyncTarget(target, lambda: OpenAIClient(target, args.model, generation))
    raise ValueError(f"--target is grpc://host:port, http://host:port/v1 or inprocess: {target}")


def json_safe(value: Any) -> Any:
    """NaN and infinity become null: the output is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def point_document(result: PointResult, seed: int, records: Sequence[RequestRecord]) -> Any:
    """One point of the --json-out document (schema: docs/benchmarks.md)."""
    return {
        "label": result.point.label,
        "request_rate": result.point.request_rate,  # inf (all at once) is written as null
        "concurrency": result.point.concurrency,
        "num_prompts": result.num_prompts,
        "seed": seed,
        "summary": asdict(result.summary),
        "requests": [
            {**asdict(record), "ttft_s": record.ttft_s, "tpot_s": record.tpot_s}
            for record in records
        ],
    }


def planned_points(args: argparse.Namespace) -> list[SweepPoint]:
    """The loads given on the command line; `--sweep` adds its rates after the first point."""
    rates: list[float] = args.request_rate
    concurrencies: list[int | None] = list(args.concurrency or [None])
    if args.sweep and (len(concurrencies) > 1 or rates != [math.inf]):
        raise ValueError(
            "--sweep measures the saturated rate and picks its own rates: "
            "give it at most one --concurrency and no --request-rate"
        )
    return sweep_points(rates, concurrencies)


def run(args: argparse.Namespace) -> int:
    try:
        if args.num_prompts < 1 or args.input_len < 1 or args.output_len < 1:
            raise ValueError("--num-prompts, --input-len and --output-len must be >= 1")
        pending = planned_points(args)
        if args.plot_out:
            require_matplotlib()
        slo = Slo(args.slo_ttft_ms, args.slo_tpot_ms)
        generation = Generation(args.temperature, args.ignore_eos, args.timeout_s)
        first_samples = build_samples(args, args.num_prompts, args.seed)
        warmup = build_samples(args, args.warmup, args.seed + WARMUP_SEED_OFFSET)
        target = make_target(args, generation)
    except (ValueError, OSError, PlotUnavailableError) as exc:
        print(f"bench serve: {exc}", file=sys.stderr)
        return 2
    load_at_start = load_average()
    mean_prompt = sum(s.prompt_len for s in first_samples) / len(first_samples)
    mean_output = sum(s.output_len for s in first_samples) / len(first_samples)
    num_points = len(pending) + (len(SATURATION_FRACTIONS) if args.sweep else 0)
    header = "\n".join(
        [
            f"command: `{command_line()}`",
            f"target: {target.description}",
            f"client cpu: {cpu_model_name()}; {load_at_start}",
            f"workload: {args.dataset}, {len(first_samples)} requests per load point "
            f"(+{args.warmup} warm-up), mean prompt {mean_prompt:.1f} tokens, mean output "
            f"{mean_output:.1f} tokens, ignore_eos {generation.ignore_eos}, "
            f"temperature {generation.temperature}",
            f"load points: {num_points}" + (" (--sweep: saturated first)" if args.sweep else ""),
        ]
    )
    print(header + "\n", flush=True)
    results: list[PointResult] = []
    documents: list[Any] = []
    try:
        while pending:
            point = pending.pop(0)
            index = len(results)
            seed = point_seed(args.seed, index)
            samples = first_samples if index == 0 else build_samples(args, args.num_prompts, seed)
            load = Load(point.request_rate, point.concurrency, args.seed)
            print(f"## load {index + 1}/{num_points}: {load.describe()}", flush=True)
            summary, records = run_point(
                target,
                samples,
                load,
                slo,
                warmup if index == 0 else (),
                description=f"load {index + 1}/{num_points}",
            )
            print(report(summary) + "\n", flush=True)
            result = PointResult(point, len(samples), summary)
            results.append(result)
            documents.append(point_document(result, seed, records))
            if args.sweep and index == 0:
                try:
                    rates = saturation_rates(summary.requests_per_s)
                except ValueError as exc:
                    print(f"bench serve: --sweep stops: {exc}", file=sys.stderr)
                    break
                pending = [SweepPoint(rate, point.concurrency) for rate in rates]
    finally:
        target.close()
    ordered = in_load_order(results)
    if len(results) > 1:
        print(format_table(SWEEP_HEADERS, sweep_rows(ordered)) + "\n(latencies in ms)")
    if args.json_out:
        document = {
            "command": sys.argv,
            "target": target.description,
            "load_average_at_start": load_at_start,
            "config": {k: v for k, v in vars(args).items() if k != "func"},
            "points": documents,
        }
        with open(args.json_out, "w", encoding="utf-8") as sink:
            json.dump(json_safe(document), sink, indent=1)
    if args.plot_out:
        title = f"{target.description}; {args.dataset} {mean_prompt:.0f}->{mean_output:.0f} tokens"
        plot_latency_vs_throughput(curve_points(ordered), Path(args.plot_out), title)
        print(f"plot: {args.plot_out}")
    return 0 if all(result.summary.num_completed for result in results) else 1


def _rates_argument(text: str) -> list[float]:
    try:
        return parse_rates(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrencies_argument(text: str) -> list[int]:
    try:
        return parse_concurrencies(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        default="grpc://127.0.0.1:50051",
        help="grpc://host:port (our API), http://host:port/v1 (OpenAI-compatible) or inprocess",
    )
    parser.add_argument("--num-prompts", type=int, default=64)
    load = parser.add_argument_group("load")
    load.add_argument(
        "--concurrency",
        type=_concurrencies_argument,
        default=None,
        help="most requests in flight (default: no cap); a list like 1,8,32,64 sweeps it",
    )
    load.add_argument(
        "--request-rate",
        type=_rates_argument,
        default=[math.inf],
        help="Poisson arrivals, requests/s (default inf: all at once); a list like 1,2,4,inf "
        "sweeps it (with a concurrency list: every pair)",
    )
    load.add_argument(
        "--sweep",
        action="store_true",
        help="run all at once to find the saturated rate, then Poisson at "
        + "/".join(f"{int(100 * f)}" for f in SATURATION_FRACTIONS)
        + "%% of it",
    )
    load.add_argument("--warmup", type=int, default=0, help="untimed requests before the run")
    load.add_argument(
        "--channels",
        type=int,
        default=None,
        help="gRPC channels, one connection each (default: min(concurrency, 8))",
    )
    load.add_argument("--timeout-s", type=float, default=None, help="per-request deadline")
    workload = parser.add_argument_group("workload")
    workload.add_argument(
        "--dataset",
        default="synthetic",
        help="synthetic (token ids) | synthetic-text (the same, sent as text re-encoded to "
        "--input-len tokens, for servers without token-id prompts) | shared-prefix | "
        "sharegpt:FILE (ShareGPT JSON)",
    )
    workload.add_argument(
        "--input-len",
        type=int,
        default=128,
        help="prompt tokens (shared-prefix: the per-user suffix after the prefix)",
    )
    workload.add_argument("--output-len", type=int, default=128, help="tokens to generate")
    workload.add_argument(
        "--length-dist",
        default="fixed",
        choices=LENGTH_DISTRIBUTIONS,
        help="synthetic: prompt and output lengths exactly --input-len/--output-len (fixed), "
        "uniform in mean*(1 +- spread), or normal with sd = spread*mean",
    )
    workload.add_argument(
        "--length-spread", type=float, default=0.25, help="synthetic uniform/normal spread"
    )
    workload.add_argument(
        "--lengths-file",
        default=None,
        help="synthetic: (input_len, output_len) pairs, CSV lines or a JSON list, cycled",
    )
    workload.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix only")
    workload.add_argument(
        "--num-prefixes", type=int, default=1, help="shared-prefix: distinct system prompts"
    )
    workload.add_argument(
        "--sharegpt-output-len",
        type=int,
        default=None,
        help="sharegpt: fixed output length instead of each reply's",
    )
    workload.add_argument(
        "--tokenizer",
        default=None,
        help="sharegpt, synthetic-text: model whose tokenizer counts lengths (default: embedded)",
    )
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the output length (default on)",
    )
    workload.add_argument("--temperature", type=float, default=0.0)
    slo = parser.add_argument_group("goodput")
    slo.add_argument("--slo-ttft-ms", type=float, default=None)
    slo.add_argument("--slo-tpot-ms", type=float, default=None)
    engine = parser.add_argument_group("inprocess target")
    engine.add_argument(
        "--model",
        default=None,
        help="inprocess: GGUF file or HF directory; http: model name (default: first listed)",
    )
    engine.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    engine.add_argument("--max-num-batched-tokens", type=int, default=1024)
    engine.add_argument("--max-num-seqs", type=int, default=128)
    engine.add_argument("--kv-cache-gib", type=float, default=1.0)
    engine.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    engine.add_argument(
        "--quantization",
        default=None,
        help="weight format, as `llmserve up --quantization` (default: the engine's)",
    )
    engine.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run every step eagerly, without compiled step graphs",
    )
    parser.add_argument(
        "--json-out", default=None, help="also write every point's summary and requests"
    )
    parser.add_argument(
        "--plot-out",
        default=None,
        help="PNG: TTFT and TPOT p50/p99 vs achieved throughput across the points "
        "(needs matplotlib: pip install 'llmserve[bench]')",
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serving load generator: TTFT/TPOT/ITL/E2E, throughput, goodput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
