"""`llmserve bench speculative`: what speculative decoding by prompt lookup buys, where users
feel it, with and without it on one stack, side by side with peers.

    llmserve bench speculative --concurrency 1,16 --rounds 3 --num-speculative-tokens 5 \\
        --peer llama-server=http://127.0.0.1:8090/v1 \\
        --peer llama-server-lookup=http://127.0.0.1:8091/v1

One stack (`llmserve up` with --stack-flags) serves both of our systems: `off` sends
num_speculative_tokens 0 with each request, `ngram` sends the limit, so the two differ in
nothing else (the same process, warm caches, the same moment of a noisy machine). Peers are
OpenAI-compatible servers started beforehand (e.g. llama.cpp's server with and without
`--spec-type ngram-simple`), sent the same chat-templated prompt text.

For each workload (speculative_workload.py: `grounded`, a 400-token passage to rewrite; `chat`,
open questions) and each concurrency C, a round gives every system in turn (the order rotates
round by round) the same C greedy requests at once, each ending at EOS or --output-len. The
table holds medians over rounds of output tok/s (tokens / wall time of the turn) and of the
turn's median TPOT, the speed-up over `off`, and for `ngram` the acceptance rate and tokens
per speculating step read from the scheduler's counters (GetStats) around its turns.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
from dataclasses import dataclass, field

from benchmarks.common import command_line, cpu_model_name, format_table, load_average
from benchmarks.serve_clients import GrpcClient, OpenAIClient
from benchmarks.serve_load import Generation
from benchmarks.serve_metrics import RequestRecord
from benchmarks.serve_workload import Sample
from benchmarks.speculative_workload import WORKLOADS, workload_messages

OFF = "off"
NGRAM = "ngram"
WARMUP_SEED = 99_991


@dataclass(slots=True)
class Turn:
    """One system's share of one round."""

    output_tok_s: float
    tpot_ms: float
    mean_output_tokens: float
    num_errors: int
    drafts: tuple[int, int, int] | None = None
    """(proposed, accepted, speculating sequence-steps) during the turn, when known."""


@dataclass(slots=True)
class Cell:
    """Every turn of one system at one workload and concurrency."""

    turns: list[Turn] = field(default_factory=list)

    def median(self, name: str) -> float:
        return statistics.median(getattr(turn, name) for turn in self.turns)

    def drafts(self) -> tuple[int, int, int] | None:
        known = [turn.drafts for turn in self.turns if turn.drafts is not None]
        if not known:
            return None
        return (sum(d[0] for d in known), sum(d[1] for d in known), sum(d[2] for d in known))


def turn_of(records: list[RequestRecord]) -> Turn:
    ok = [r for r in records if r.ok and r.chunks]
    if not ok:
        raise RuntimeError(f"no request succeeded: {sorted({str(r.error) for r in records})}")
    started = min(r.send_time_s for r in records)
    wall = max(r.end_time_s for r in ok) - started
    tokens = sum(r.output_tokens for r in ok)
    tpots = [
        (r.end_time_s - r.chunks[0].time_s) * 1000 / (r.output_tokens - 1)
        for r in ok
        if r.output_tokens > 1
    ]
    return Turn(
        output_tok_s=tokens / wall,
        tpot_ms=statistics.median(tpots) if tpots else float("nan"),
        mean_output_tokens=tokens / len(ok),
        num_errors=len(records) - len(ok),
    )


def table_rows(results: dict[tuple[str, int, str], Cell]) -> list[list[object]]:
    rows: list[list[object]] = []
    for (workload, concurrency, system), cell in results.items():
        base = results.get((workload, concurrency, OFF))
        tok_s = cell.median("output_tok_s")
        speedup = tok_s / base.median("output_tok_s") if base is not None else float("nan")
        drafts = cell.drafts()
        if drafts is None or drafts[0] == 0:
            acceptance: object = "-"
            per_step: object = "-"
        else:
            acceptance = f"{drafts[1] / drafts[0]:.0%}"
            per_step = f"{1 + drafts[1] / drafts[2]:.2f}"
        rows.append(
            [
                workload,
                concurrency,
                system,
                tok_s,
                cell.median("tpot_ms"),
                f"{speedup:.2f}x",
                acceptance,
                per_step,
                cell.median("mean_output_tokens"),
                sum(turn.num_errors for turn in cell.turns),
            ]
        )
    return rows


HEADERS = [
    "workload",
    "C",
    "system",
    "output tok/s",
    "TPOT p50 ms",
    "vs off",
    "acceptance",
    "tokens/step",
    "output tokens",
    "errors",
]


def samples_for(workload: str, count: int, seed: int, output_len: int) -> list[Sample]:
    from services.common.model_source import resolve_model_path
    from services.text.model_tokenizer import ModelTokenizer

    tokenizer = _TOKENIZER.get("model") or ModelTokenizer.from_path(resolve_model_path(None))
    _TOKENIZER["model"] = tokenizer
    samples = []
    for messages in workload_messages(workload, count, seed):
        text = tokenizer.render_chat(messages, add_generation_prompt=True)
        length = len(tokenizer.encode(text, add_special_tokens=False))
        samples.append(Sample((), output_len, prompt_text=text, prompt_len_hint=length))
    return samples


_TOKENIZER: dict[str, object] = {}


async def measure(args: argparse.Namespace, stack: object) -> dict[tuple[str, int, str], Cell]:
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    channels = min(8, max(concurrencies))
    greedy = {"temperature": 0.0, "ignore_eos": False, "timeout_s": args.timeout_s}
    clients: dict[str, GrpcClient | OpenAIClient] = {
        OFF: GrpcClient(
            stack.public,  # type: ignore[attr-defined]
            channels,
            Generation(**greedy, num_speculative_tokens=0),  # type: ignore[arg-type]
        ),
        NGRAM: GrpcClient(
            stack.public,  # type: ignore[attr-defined]
            channels,
            Generation(**greedy, num_speculative_tokens=args.num_speculative_tokens),  # type: ignore[arg-type]
        ),
    }
    for name, url in args.peer:
        clients[name] = OpenAIClient(url, None, Generation(**greedy))  # type: ignore[arg-type]
    for client in clients.values():
        await client.start()

    async def turn(name: str, samples: list[Sample]) -> Turn:
        before = stack.stats() if name == NGRAM else None  # type: ignore[attr-defined]
        client = clients[name]
        records = await asyncio.gather(
            *(client.generate(sample, slot) for slot, sample in enumerate(samples))
        )
        result = turn_of(list(records))
        if before is not None:
            after = stack.stats()  # type: ignore[attr-defined]
            result.drafts = (
                after.num_draft_tokens_proposed - before.num_draft_tokens_proposed,
                after.num_draft_tokens_accepted - before.num_draft_tokens_accepted,
                after.num_speculative_steps - before.num_speculative_steps,
            )
        return result

    results: dict[tuple[str, int, str], Cell] = {}
    names = list(clients)
    try:
        for workload in args.workloads.split(","):
            for concurrency in concurrencies:
                warmup = samples_for(workload, 2, WARMUP_SEED, args.output_len)
                for name in names:
                    await turn(name, warmup)
                for index in range(args.rounds):
                    seed = 1000 * concurrency + index
                    samples = samples_for(workload, concurrency, seed, args.output_len)
                    order = names[index % len(names) :] + names[: index % len(names)]
                    line = []
                    for name in order:
                        outcome = await turn(name, samples)
                        results.setdefault((workload, concurrency, name), Cell()).turns.append(
                            outcome
                        )
                        line.append(f"{name} {outcome.output_tok_s:.1f} tok/s")
                    print(
                        f"{workload} C={concurrency} round {index + 1}/{args.rounds}: "
                        + ", ".join(line),
                        flush=True,
                    )
    finally:
        for client in clients.values():
            await client.close()
    # Rows in a stable order: workload, concurrency, then the systems as given.
    return {
        (w, c, n): results[(w, c, n)]
        for w in args.workloads.split(",")
        for c in concurrencies
        for n in names
        if (w, c, n) in results
    }


def run(args: argparse.Namespace) -> int:
    from services.stack import running_stack

    for workload in args.workloads.split(","):
        if workload not in WORKLOADS:
            raise SystemExit(f"--workloads: each is one of {WORKLOADS}, got {workload!r}")
    print(f"command: `{command_line()}`")
    print(f"cpu: {cpu_model_name()}; {load_average()}")
    print(
        f"greedy requests ending at EOS or {args.output_len} tokens; ngram = "
        f"num_speculative_tokens {args.num_speculative_tokens}, off = 0; {args.rounds} rounds\n",
        flush=True,
    )
    flags = ["--tokenizer-replicas", "1", *shlex.split(args.stack_flags)]
    print(f"$ llmserve up {shlex.join(flags)}", flush=True)
    with running_stack(flags, startup_timeout_s=900.0) as stack:
        results = asyncio.run(measure(args, stack))
    print(f"\n{format_table(HEADERS, table_rows(results))}")
    print(
        "medians over the rounds; acceptance = accepted / proposed drafts; tokens/step = "
        "tokens a speculating sequence emitted per step"
    )
    return 0


def parse_peer(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name.strip() or name.strip() in (OFF, NGRAM):
        raise argparse.ArgumentTypeError(f"--peer takes NAME=http://host:port/v1, got {text!r}")
    return name.strip(), url.strip()


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workloads", default="grounded,chat", help=f"of {', '.join(WORKLOADS)}")
    parser.add_argument("--concurrency", default="1,16", help="comma-separated request counts")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=256, help="most tokens per answer")
    parser.add_argument("--num-speculative-tokens", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument(
        "--stack-flags", default="", help="flags of the `llmserve up` this starts (one string)"
    )
    parser.add_argument(
        "--peer",
        type=parse_peer,
        action="append",
        default=[],
        metavar="NAME=URL",
        help="an OpenAI-compatible server to measure too (repeatable)",
    )
    parser.set_defaults(func=run)


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "speculative",
        help="speculative decoding on and off, grounded and chat workloads, beside peers",
    )
    configure_parser(parser)


def main() -> int:
    parser = argparse.ArgumentParser(prog="llmserve bench speculative")
    configure_parser(parser)
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
