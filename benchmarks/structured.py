"""What structured output costs a decode step: the in-process engine decoding B sequences on the
same prompts, once unconstrained and once with every sequence under a JSON schema, and the
mask's own time per step (xgrammar's fill of the constrained rows' bitmask, then its apply to
the logits).

    llmserve bench structured --batch-sizes 1,16 --context 128 --steps 30 --rounds 3

Two constraints: `json_schema` (response_format's kind) and `tool_call` (the grammar a forced
tool call gets: tool_choice "required" over two tools, the answer a JSON list of calls whose
arguments follow each tool's schema).

Accept is the matchers taking each step's sampled tokens; the grammar share is fill + apply +
accept over the constrained step; the overhead compares the medians of the two kinds of run.

Both schemas hold an array of at least 200 short strings (a tool's `notes` argument), so no
output can complete within the measured steps: every row stays constrained and the batch
stays whole.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from time import perf_counter
from typing import Any

import torch

from benchmarks.common import format_table, machine_header, random_prompts
from services.contracts.sampling_params import SamplingParams
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.tokenizer.tool_request import (
    FunctionTool,
    ToolChoiceMode,
    ToolRequest,
    forced_call_grammar,
)
from services.worker import sampler as sampler_module

SCHEMA = {
    "type": "object",
    "properties": {
        "notes": {
            "type": "array",
            "items": {"type": "string", "maxLength": 24},
            "minItems": 200,
        }
    },
    "required": ["notes"],
}
TOOLS = ToolRequest(
    (
        FunctionTool("take_notes", "Write notes down", SCHEMA),
        FunctionTool(
            "get_weather",
            "The weather in a city",
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        ),
    ),
    ToolChoiceMode.REQUIRED,
)
CONSTRAINTS = {
    "json_schema": StructuredOutput(StructuredOutputKind.JSON_SCHEMA, json.dumps(SCHEMA)),
    "tool_call": forced_call_grammar(TOOLS),
}
HEADERS = [
    "batch",
    "constraint",
    "ms / step",
    "fill ms",
    "apply ms",
    "accept ms",
    "grammar share",
    "overhead",
]


class MaskTimer:
    """Wall time spent in the grammar's fill, apply and accept, summed per kind (the bench's
    own wrappers around the runner's and the sampler's calls)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.seconds = {"fill": 0.0, "apply": 0.0, "accept": 0.0}
        grammars = engine.runner.grammars
        assert grammars is not None
        apply = sampler_module.apply_grammar_mask
        grammars.fill = self._timed("fill", grammars.fill)  # type: ignore[method-assign]
        grammars.accept = self._timed("accept", grammars.accept)  # type: ignore[method-assign]
        sampler_module.apply_grammar_mask = self._timed("apply", apply)

        def undo() -> None:
            del grammars.fill  # back to the class's methods
            del grammars.accept
            sampler_module.apply_grammar_mask = apply

        self._undo: Callable[[], None] = undo

    def _timed(self, kind: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            started = perf_counter()
            try:
                return call(*args)
            finally:
                self.seconds[kind] += perf_counter() - started

        return timed

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.seconds, 0.0)

    def close(self) -> None:
        self._undo()


def decode_ms(
    engine: LLMEngine,
    timer: MaskTimer,
    prompts: list[list[int]],
    steps: int,
    spec: StructuredOutput | None,
) -> tuple[float, float, float, float]:
    """(ms per decode step, then fill, apply and accept ms per step) over `steps` pure
    decodes, every sequence under `spec` (None: unconstrained)."""
    sampling = SamplingParams(
        temperature=0.0,
        max_new_tokens=steps + 8,
        ignore_eos=spec is None,
        structured_output=spec,
    )
    for prompt in prompts:
        engine.add_request(prompt, sampling)
    context = len(prompts[0])
    while engine.get_stats().num_waiting or any(
        seq.num_computed_tokens < context for seq in engine.runner.batch.sequences.values()
    ):
        engine.step()
    for _ in range(2):
        engine.step()
    timer.reset()
    start = perf_counter()
    for _ in range(steps):
        engine.step()
    wall_ms = (perf_counter() - start) * 1e3 / steps
    fill_ms, apply_ms, accept_ms = (
        timer.seconds[kind] * 1e3 / steps for kind in ("fill", "apply", "accept")
    )
    if engine.runner.batch.sequences and len(engine.runner.batch.sequences) != len(prompts):
        print(f"note: only {len(engine.runner.batch.sequences)} of {len(prompts)} sequences ran")
    for request_id in list(engine.scheduler.requests):
        engine.abort(request_id)
    while engine.has_unfinished_requests():  # the plan that drops them from the runner
        engine.step()
    return wall_ms, fill_ms, apply_ms, accept_ms


def run(args: argparse.Namespace) -> int:
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=max(batch_sizes),
            max_num_batched_tokens=max(2048, args.context * max(batch_sizes)),
            enforce_eager=args.enforce_eager,
            threads=args.threads,
            seed=0,
        )
    )
    timer = MaskTimer(engine)
    started = perf_counter()
    grammars = engine.runner.grammars
    assert grammars is not None
    constraints = [name.strip() for name in args.constraints.split(",")]
    for name in constraints:
        spec = CONSTRAINTS.get(name)
        if spec is None:
            print(f"unknown constraint {name!r}; known: {', '.join(CONSTRAINTS)}")
            return 2
        grammars.compiler.compile(spec)
    compile_ms = (perf_counter() - started) * 1e3
    print(machine_header(torch.get_num_threads()))
    print(
        f"model: {engine.model_name}; dtype: {engine.dtype}; context {args.context}; "
        f"{args.steps} decode steps; grammars compiled once in {compile_ms:.0f} ms (not in the "
        "step times)\n"
    )
    rows: list[list[object]] = []
    try:
        # One constrained run first, not measured: the first matcher steps pay one-time costs
        # (measured: close to a second on this model).
        for name in constraints:
            decode_ms(engine, timer, random_prompts(1, args.context, seed=0), 4, CONSTRAINTS[name])
        for batch in batch_sizes:
            prompts = random_prompts(batch, args.context, seed=batch)
            kinds: list[str | None] = [None, *constraints]
            results: dict[str | None, list[tuple[float, float, float, float]]] = {
                kind: [] for kind in kinds
            }
            # Rounds rotate which run goes first, so a drift of the machine's speed falls on
            # every kind alike; the table holds medians.
            for round_index in range(args.rounds):
                shift = round_index % len(kinds)
                for kind in kinds[shift:] + kinds[:shift]:
                    spec = CONSTRAINTS[kind] if kind is not None else None
                    results[kind].append(decode_ms(engine, timer, prompts, args.steps, spec))
            plain_ms = statistics.median(result[0] for result in results[None])
            rows.append([batch, "none", plain_ms, 0.0, 0.0, 0.0, "", ""])
            for name in constraints:
                step, fill, apply, accept = (
                    statistics.median(values) for values in zip(*results[name], strict=True)
                )
                rows.append(
                    [
                        batch,
                        name,
                        step,
                        fill,
                        apply,
                        accept,
                        f"{100 * (fill + apply + accept) / step:.1f} %",
                        f"{100 * (step - plain_ms) / plain_ms:+.1f} %",
                    ]
                )
    finally:
        timer.close()
    print(format_table(HEADERS, rows))
    return 0


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser(
        "structured",
        help="decode ms/step with and without a JSON-schema constraint, and the mask's cost",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument(
        "--constraints",
        default=",".join(CONSTRAINTS),
        help=f"comma-separated, of: {', '.join(CONSTRAINTS)}",
    )
    parser.add_argument("--context", type=int, default=128, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=30, help="measured decode steps")
    parser.add_argument(
        "--rounds", type=int, default=3, help="runs of each kind per batch size (medians)"
    )
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.set_defaults(func=run)


if __name__ == "__main__":
    main_parser = argparse.ArgumentParser()
    add_parser(main_parser.add_subparsers(dest="command", required=True))
    parsed = main_parser.parse_args(["structured", *sys.argv[1:]])
    sys.exit(parsed.func(parsed))
