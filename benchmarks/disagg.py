"""`llmserve bench disagg`: does prefill/decode disaggregation pay on this machine, at equal
total threads? (docs/disaggregation.md, docs/benchmarks.md)

    llmserve bench disagg                       # the full run (tens of minutes on 2 cores)
    llmserve bench disagg --quick               # a smoke run: short, one chunk size

Stacks, one after the other (all `llmserve up`, the embedded model unless --model):
  colocated      1 pair (role both), --threads threads, once per --chunk-sizes value
                 (--max-num-batched-tokens); the chunk size with the lowest chat TPOT p99 is kept
  disaggregated  1 prefill pair + 1 decode pair, --threads / 2 threads each
Workload on each: --chat-users users streaming --chat-output-tokens tokens from short prompts,
back to back, while a --document-tokens prompt arrives every --documents-every-s, for
--duration-s. Then a chat-only run (no documents) on the best colocated and the disaggregated
stack: every request should stay on the decode pair, so its tok/s is what the split costs.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from benchmarks.common import (
    command_line,
    cpu_model_name,
    cpu_simd_flags,
    format_table,
    positive_float,
    positive_int,
)
from benchmarks.common import load_average as load_average_line
from benchmarks.disagg_report import (
    HEADERS,
    RATIO_HEADERS,
    RunResult,
    Transfer,
    best_colocated,
    document_times,
    prompt_ids,
    ratio_rows,
    result_row,
    target_ratios,
)
from benchmarks.serve_stack import log_tail

TRANSFER_DIRECTION = "sent"
"""The prefill worker's view of a transfer: first chunk out to the decode worker's ack."""
STOP_TIMEOUT_S = 90.0


@dataclass(slots=True)
class Recorded:
    """What the clients saw during one run (appended to from several threads; list.append is
    atomic under the GIL)."""

    chat_tpot_s: list[float] = field(default_factory=list)
    chat_output_tokens: list[int] = field(default_factory=list)
    chat_end_s: list[float] = field(default_factory=list)
    document_ttft_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def stream(stub: object, ids: list[int], max_new_tokens: int) -> list[float]:
    """One greedy request (ignore_eos); the arrival time of each of its tokens."""
    from protos.llmserve.v1 import text_pb2

    sampling = text_pb2.SamplingParams(
        temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True
    )
    request = text_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
    arrivals: list[float] = []
    for response in stub.Generate(request, timeout=3600):  # type: ignore[attr-defined]
        now = time.perf_counter()
        arrivals.extend(now for _ in response.token_ids)
    return arrivals


def run_workload(address: str, args: argparse.Namespace, documents: bool, name: str) -> RunResult:
    """The chat users and (with `documents`) the document schedule against one stack."""
    import grpc

    from protos.llmserve.v1 import text_pb2_grpc

    stub = text_pb2_grpc.TextGenerationStub(grpc.insecure_channel(address))
    recorded = Recorded()
    started = time.perf_counter()
    deadline = started + args.duration_s

    def chat_user(user: int) -> None:
        index = 0
        while time.perf_counter() < deadline:
            ids = prompt_ids(user + 1, index, args.chat_prompt_tokens)
            index += 1
            try:
                arrivals = stream(stub, ids, args.chat_output_tokens)
            except grpc.RpcError as exc:
                recorded.errors.append(f"chat: {exc.code().name}")  # type: ignore[attr-defined]
                continue
            if len(arrivals) > 1:
                recorded.chat_tpot_s.append((arrivals[-1] - arrivals[0]) / (len(arrivals) - 1))
            recorded.chat_output_tokens.append(len(arrivals))
            recorded.chat_end_s.append(arrivals[-1] if arrivals else time.perf_counter())

    def document(index: int) -> None:
        # Stream 0 is the documents': their prompts never share a prefix with a chat's.
        ids = prompt_ids(0, index, args.document_tokens)
        sent = time.perf_counter()
        try:
            arrivals = stream(stub, ids, args.document_output_tokens)
        except grpc.RpcError as exc:
            recorded.errors.append(f"document: {exc.code().name}")  # type: ignore[attr-defined]
            return
        if arrivals:
            recorded.document_ttft_s.append(arrivals[0] - sent)

    threads = [threading.Thread(target=chat_user, args=(u,)) for u in range(args.chat_users)]
    schedule = document_times(args.duration_s, args.documents_every_s) if documents else []
    for thread in threads:
        thread.start()
    for index, at in enumerate(schedule):
        time.sleep(max(0.0, started + at - time.perf_counter()))
        thread = threading.Thread(target=document, args=(index,))
        thread.start()
        threads.append(thread)
    for thread in threads:
        thread.join()
    if recorded.errors:
        print(f"{name}: {len(recorded.errors)} failed requests: {recorded.errors[:5]}", flush=True)
    return RunResult(
        name=name,
        chat_tpot_s=recorded.chat_tpot_s,
        chat_output_tokens=sum(recorded.chat_output_tokens),
        wall_s=max(recorded.chat_end_s, default=started) - started,
        document_ttft_s=recorded.document_ttft_s,
    )


def scrape_transfer(metrics_urls: list[str]) -> Transfer:
    """The `sent` transfer counters summed over the given workers' /metrics."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals = {"bytes": 0.0, "seconds": 0.0, "count": 0.0}
    wanted = {
        "llmserve_kv_transfer_bytes_total": "bytes",
        "llmserve_kv_transfer_seconds_sum": "seconds",
        "llmserve_kv_transfer_seconds_count": "count",
    }
    for url in metrics_urls:
        text = httpx.get(url, timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                key = wanted.get(sample.name)
                if key and sample.labels.get("direction") == TRANSFER_DIRECTION:
                    totals[key] += sample.value
    return Transfer(totals["bytes"], totals["seconds"], totals["count"])


def model_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--tokenizer-replicas", "1", "--metrics-port", "0"]
    return flags + (["--model", args.model] if args.model else [])


def colocated_flags(args: argparse.Namespace, chunk: int) -> list[str]:
    return [
        *model_flags(args),
        *("--workers", "1", "--worker-threads", str(args.threads)),
        *("--max-num-batched-tokens", str(chunk)),
    ]


def disaggregated_flags(args: argparse.Namespace, chunk: int) -> list[str]:
    # Equal total threads: the colocated pair's split between the two pairs.
    return [
        *model_flags(args),
        *("--prefill-pairs", "1", "--decode-pairs", "1"),
        *("--worker-threads", str(max(1, args.threads // 2))),
        *("--max-num-batched-tokens", str(chunk)),
        *("--disaggregate-min-prompt", str(args.disaggregate_min_prompt)),
    ]


@contextlib.contextmanager
def stack(flags: list[str]) -> Iterator[object]:
    """A started stack, its logs kept out of the report (their tail shown if it fails)."""
    from services.launcher import StackConfig
    from services.stack import running_stack

    print(f"$ llmserve up {shlex.join(flags)}", flush=True)
    with tempfile.TemporaryFile() as log:
        try:
            with running_stack(
                flags,
                startup_timeout_s=StackConfig().startup_timeout_s,
                stop_timeout_s=STOP_TIMEOUT_S,
                stderr=log,
            ) as running:
                yield running
        except (RuntimeError, TimeoutError, OSError):
            print(log_tail(log), file=sys.stderr)
            raise


def warm_up(address: str, args: argparse.Namespace) -> None:
    """One chat and one document, unmeasured: first-call compilation counts in no figure."""
    import grpc

    from protos.llmserve.v1 import text_pb2_grpc

    stub = text_pb2_grpc.TextGenerationStub(grpc.insecure_channel(address))
    stream(stub, prompt_ids(10_000, 0, args.chat_prompt_tokens), 4)
    stream(stub, prompt_ids(10_001, 0, args.document_tokens), 2)


def run_colocated(args: argparse.Namespace, chunk: int, chat_only: bool) -> list[RunResult]:
    results = []
    with stack(colocated_flags(args, chunk)) as running:
        address = running.public  # type: ignore[attr-defined]
        warm_up(address, args)
        name = f"colocated, chunk {chunk}"
        results.append(run_workload(address, args, documents=True, name=name))
        print(format_table(HEADERS, [result_row(results[-1])]), flush=True)
        if chat_only:
            results.append(run_workload(address, args, False, f"{name}, chat only"))
    return results


def run_disaggregated(args: argparse.Namespace, chunk: int) -> list[RunResult]:
    with stack(disaggregated_flags(args, chunk)) as running:
        address = running.public  # type: ignore[attr-defined]
        info = running.info  # type: ignore[attr-defined]
        workers = [url for name, url in info["process_metrics"].items() if "worker" in name]
        warm_up(address, args)
        before = scrape_transfer(workers)
        mixed = run_workload(address, args, documents=True, name="disaggregated")
        mixed = RunResult(**{**_fields(mixed), "transfer": scrape_transfer(workers) - before})
        print(format_table(HEADERS, [result_row(mixed)]), flush=True)
        before = scrape_transfer(workers)
        chat_only = run_workload(address, args, False, "disaggregated, chat only")
        moved = scrape_transfer(workers) - before
        chat_only = RunResult(**{**_fields(chat_only), "transfer": moved})
    return [mixed, chat_only]


def _fields(result: RunResult) -> dict[str, object]:
    return {name: getattr(result, name) for name in RunResult.__slots__}


def run(args: argparse.Namespace) -> int:
    if args.quick:
        args.chunk_sizes = args.chunk_sizes[-1:]
        args.duration_s = min(args.duration_s, 20.0)
    print(f"command: `{command_line()}`")
    print(f"cpu: {cpu_model_name()}; flags: {' '.join(cpu_simd_flags()) or 'unknown'}")
    print(f"{load_average_line()}")
    print(
        f"workload: {args.chat_users} chat users x {args.chat_output_tokens} tokens from "
        f"{args.chat_prompt_tokens}-token prompts; a {args.document_tokens}-token document "
        f"every {args.documents_every_s:g} s; {args.duration_s:g} s per run; model: "
        f"{args.model or 'embedded'}\n",
        flush=True,
    )
    if args.document_tokens < args.disaggregate_min_prompt:
        raise SystemExit(
            f"--document-tokens ({args.document_tokens}) is below --disaggregate-min-prompt "
            f"({args.disaggregate_min_prompt}): no document would reach the prefill pair"
        )
    single = len(args.chunk_sizes) == 1
    colocated: list[RunResult] = []
    chat_only_runs: list[RunResult] = []
    for chunk in args.chunk_sizes:
        mixed, *chat_only = run_colocated(args, chunk, chat_only=single)
        colocated.append(mixed)
        chat_only_runs += chat_only
    best = best_colocated(colocated)
    best_chunk = args.chunk_sizes[colocated.index(best)]
    print(f"colocated best: chunk {best_chunk}\n", flush=True)
    # Swept: the best colocated stack again for its chat-only figure, right before the
    # disaggregated runs, so the two chat-only runs see the machine in the same state.
    best_chat_only = (
        chat_only_runs[-1] if single else run_colocated(args, best_chunk, chat_only=True)[-1]
    )
    disaggregated, disaggregated_chat_only = run_disaggregated(args, best_chunk)

    rows = [result_row(r) for r in [*colocated, disaggregated, best_chat_only]]
    rows.append(result_row(disaggregated_chat_only))
    print(f"\n{format_table(HEADERS, rows)}")
    ratios = target_ratios(best, disaggregated, best_chat_only, disaggregated_chat_only)
    print(f"\n{format_table(RATIO_HEADERS, ratio_rows(ratios))}")
    moved = disaggregated_chat_only.transfer
    if moved is not None and moved.count:
        print(f"note: the chat-only run moved {moved.count:g} prompts (expected none)")
    return 0


def positive_int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(
            f"--chunk-sizes: comma-separated ints, got {text!r}"
        ) from exc
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"--chunk-sizes: positive ints, got {text!r}")
    return values


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="a GGUF file (default: embedded model)")
    parser.add_argument("--threads", type=positive_int, default=2, help="total worker threads")
    parser.add_argument(
        "--chunk-sizes",
        type=positive_int_list,
        default=[128, 256, 512, 1024],
        help="--max-num-batched-tokens values the colocated pair is swept over",
    )
    parser.add_argument("--chat-users", type=positive_int, default=8)
    parser.add_argument("--chat-prompt-tokens", type=positive_int, default=32)
    parser.add_argument("--chat-output-tokens", type=positive_int, default=256)
    parser.add_argument("--document-tokens", type=positive_int, default=2048)
    parser.add_argument("--document-output-tokens", type=positive_int, default=16)
    parser.add_argument("--documents-every-s", type=positive_float, default=5.0)
    parser.add_argument("--duration-s", type=positive_float, default=120.0)
    parser.add_argument(
        "--disaggregate-min-prompt",
        type=positive_int,
        default=512,
        help="shortest prompt the disaggregated stack sends to its prefill pair",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: the largest chunk size only, <= 20 s"
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "disagg", help="prefill/decode disaggregation vs a colocated pair at equal threads"
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench disagg")
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
