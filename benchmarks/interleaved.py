"""`llmserve bench interleaved`: stacks and the in-process engine measured in turns, round after
round, so the noise of a shared machine falls on every system alike.

    llmserve bench interleaved --rounds 8 --concurrency 1 \\
        --stack none="--cpu-placement none" --stack serial="--scheduling serial"

Every stack (`llmserve up` with its flags) and the in-process engine are up at once; a round
gives each system in turn the same C requests (prompt and output lengths fixed, greedy,
ignore_eos), and the table holds each system's median over the rounds of its TPOT p50 and
output tok/s, and their ratios to the in-process engine. A system not in its turn is idle.
`bench serve --compare-inprocess` runs one system after the other instead: simpler, but on a
machine whose speed drifts by 15 % within minutes, its ratios drift too.
"""

from __future__ import annotations

import argparse
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass

from benchmarks.common import command_line, cpu_model_name, format_table, load_average

INPROCESS = "in-process"
Prompts = list[list[int]]


@dataclass(frozen=True, slots=True)
class RoundResult:
    tpot_p50_ms: float
    output_tok_s: float


def parse_stack(text: str) -> tuple[str, list[str]]:
    """`name=flags` (flags as a shell would split them) -> (name, flags)."""
    name, sep, flags = text.partition("=")
    if not sep or not name.strip() or name.strip() == INPROCESS:
        raise argparse.ArgumentTypeError(f'--stack takes NAME="llmserve up flags", got {text!r}')
    return name.strip(), shlex.split(flags)


def round_result(arrivals: Sequence[Sequence[float]], started: float) -> RoundResult:
    """From each request's token arrival times: the median TPOT and the round's tok/s."""
    streams = [times for times in arrivals if times]
    if not streams:
        raise ValueError("no request streamed a token")
    tpots = [(t[-1] - t[0]) * 1000 / (len(t) - 1) for t in streams if len(t) > 1]
    wall = max(t[-1] for t in streams) - started
    tokens = sum(len(t) for t in streams)
    return RoundResult(statistics.median(tpots) if tpots else float("nan"), tokens / wall)


def interleaved_rows(results: dict[str, list[RoundResult]]) -> list[list[object]]:
    """One row per system: medians over rounds and ratios to the in-process engine."""

    def medians(rounds: list[RoundResult]) -> tuple[float, float]:
        return (
            statistics.median(r.tpot_p50_ms for r in rounds),
            statistics.median(r.output_tok_s for r in rounds),
        )

    base_tpot, base_tok_s = medians(results[INPROCESS])
    rows: list[list[object]] = []
    for name, rounds in results.items():
        tpot, tok_s = medians(rounds)
        rows.append([name, tpot, tpot / base_tpot, tok_s, tok_s / base_tok_s])
    return rows


HEADERS = ["system", "TPOT p50 ms", "TPOT / in-process", "output tok/s", "tok/s / in-process"]


def run_rounds(
    systems: dict[str, Callable[[Prompts], RoundResult]],
    rounds: int,
    concurrency: int,
    input_len: int,
    vocab: int,
) -> dict[str, list[RoundResult]]:
    """One unmeasured warm-up each, then `rounds` rounds in which every system in turn gets
    the round's prompts; prints a line per round."""
    for measure in systems.values():
        measure(prompts_for_round(-1, 2, input_len, vocab))
    results: dict[str, list[RoundResult]] = {name: [] for name in systems}
    for index in range(rounds):
        prompts = prompts_for_round(index, concurrency, input_len, vocab)
        for name, measure in systems.items():
            results[name].append(measure(prompts))
        line = ", ".join(
            f"{n} {r[-1].tpot_p50_ms:.1f} ms {r[-1].output_tok_s:.1f} tok/s"
            for n, r in results.items()
        )
        print(f"round {index + 1}/{rounds}: {line}", flush=True)
    return results


def prompts_for_round(index: int, concurrency: int, input_len: int, vocab: int) -> Prompts:
    """Distinct token-id prompts (no prefix-cache hits across requests or rounds)."""
    base = 1000 + index * concurrency * 7919
    return [
        [
            (base + request * 104729 + position * 31) % (vocab - 1000) + 1000
            for position in range(input_len)
        ]
        for request in range(concurrency)
    ]


def stack_system(address: str, output_len: int) -> Callable[[Prompts], RoundResult]:
    import grpc

    from protos.llmserve.v1 import text_pb2, text_pb2_grpc

    stub = text_pb2_grpc.TextGenerationStub(grpc.insecure_channel(address))
    sampling = text_pb2.SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)

    def one(ids: list[int]) -> list[float]:
        request = text_pb2.GenerateRequest(prompt_token_ids=ids, sampling=sampling)
        arrivals: list[float] = []
        for response in stub.Generate(request, timeout=3600):
            now = time.perf_counter()
            arrivals.extend(now for _ in response.token_ids)
        return arrivals

    def run(prompts: Prompts) -> RoundResult:
        started = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            return round_result(list(pool.map(one, prompts)), started)

    return run


def inprocess_system(engine: object, output_len: int) -> Callable[[Prompts], RoundResult]:
    from services.contracts.sampling_params import SamplingParams

    sampling = SamplingParams(temperature=0.0, max_new_tokens=output_len, ignore_eos=True)

    def run(prompts: Prompts) -> RoundResult:
        arrivals: dict[str, list[float]] = {
            engine.add_request(ids, sampling): []
            for ids in prompts  # type: ignore[attr-defined]
        }
        started = time.perf_counter()
        while engine.has_unfinished_requests():  # type: ignore[attr-defined]
            events = engine.step()  # type: ignore[attr-defined]
            now = time.perf_counter()
            for event in events:
                arrivals[event.request_id].extend(now for _ in event.new_token_ids)
        return round_result(list(arrivals.values()), started)

    return run


def run(args: argparse.Namespace) -> int:
    from services.engine.config import EngineConfig
    from services.engine.engine import LLMEngine
    from services.stack import running_stack

    print(f"command: `{command_line()}`")
    print(f"cpu: {cpu_model_name()}; {load_average()}")
    print(
        f"rounds: {args.rounds}, each system in turn: {args.concurrency} requests of "
        f"{args.input_len} prompt + {args.output_len} greedy tokens (ignore_eos)\n",
        flush=True,
    )
    with ExitStack() as running:
        systems: dict[str, Callable[[Prompts], RoundResult]] = {}
        for name, flags in args.stack or [("stack", [])]:
            print(f"$ llmserve up {shlex.join(flags)}  # {name}", flush=True)
            stack = running.enter_context(
                running_stack(["--tokenizer-replicas", "1", *flags], startup_timeout_s=900.0)
            )
            systems[name] = stack_system(stack.public, args.output_len)
        engine = LLMEngine(EngineConfig(seed=0))
        vocab = engine.model.architecture.vocab_size
        systems = {INPROCESS: inprocess_system(engine, args.output_len), **systems}
        results = run_rounds(systems, args.rounds, args.concurrency, args.input_len, vocab)
    print(f"\n{format_table(HEADERS, interleaved_rows(results))}")
    print("medians over the rounds; TPOT lower is better, tok/s higher is better")
    return 0


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--concurrency", type=int, default=1, help="requests per round")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--stack",
        type=parse_stack,
        action="append",
        default=[],
        metavar='NAME="FLAGS"',
        help="a stack to measure: a name and its `llmserve up` flags (repeatable; none given: "
        "one stack with the default flags)",
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "interleaved", help="stacks and the in-process engine measured in turns, round by round"
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench interleaved")
    configure_parser(parser)
    args = parser.parse_args()
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
