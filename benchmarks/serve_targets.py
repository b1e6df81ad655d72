"""The targets of `llmserve bench serve` (serve.py): parsing `--target [LABEL=]URL`, the API key
and trusted CAs each remote target gets, and building the client of each kind (our gRPC
door, any OpenAI-compatible HTTP server, an in-process engine)."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks.serve_clients import Access, GrpcClient, InProcessTarget, OpenAIClient
from benchmarks.serve_flags import API_KEY_VARIABLES, DEFAULT_TARGET
from benchmarks.serve_load import (
    AsyncTarget,
    Generation,
    Target,
)

if TYPE_CHECKING:
    from services.engine.config import EngineConfig

MAX_DEFAULT_CHANNELS = 8
INPROCESS_TARGET = "inprocess"
TARGET_SCHEMES = ("grpc://", "grpcs://", "http://", "https://")
TLS_SCHEMES = ("grpcs://", "https://")
ENGINE_SEED = 0
"""The in-process engine's sampler seed; a stack started for --compare-inprocess gets it too."""

_TOKENIZERS: dict[str | None, Any] = {}


def prompt_tokenizer(args: argparse.Namespace) -> Any:
    """The --tokenizer model's tokenizer, loaded once (every sweep point builds prompts)."""
    if args.tokenizer not in _TOKENIZERS:
        from services.common.model_source import resolve_model_path
        from services.text.model_tokenizer import ModelTokenizer

        _TOKENIZERS[args.tokenizer] = ModelTokenizer.from_path(resolve_model_path(args.tokenizer))
    return _TOKENIZERS[args.tokenizer]


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The in-process engine's config; building it checks the flags (quantization, KV dtype)."""
    from services.engine.config import EngineConfig

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        threads=args.threads,
        enforce_eager=args.enforce_eager,
        speculation=False if args.no_speculation else None,
        seed=ENGINE_SEED,
    )
    # Without --quantization the engine's own default applies.
    if args.quantization is not None:
        config = replace(config, quantization=args.quantization)
    return config


def inprocess_target(config: EngineConfig, generation: Generation) -> Target:
    """Loads the model (and compiles its step graphs): the slow part of a run's start."""
    from services.engine.engine import LLMEngine

    return InProcessTarget(LLMEngine(config), generation)


def grpc_target(
    args: argparse.Namespace, target: str, generation: Generation, access: Access | None = None
) -> Target:
    tls = target.startswith("grpcs://")
    address = target.removeprefix("grpcs://" if tls else "grpc://")
    most_in_flight = max(args.concurrency) if args.concurrency else args.num_prompts
    channels = args.channels or min(most_in_flight, MAX_DEFAULT_CHANNELS)
    return AsyncTarget(
        f"{target} ({channels} channels)",
        lambda: GrpcClient(address, channels, generation, tls=tls, access=access),
    )


def make_target(
    args: argparse.Namespace, generation: Generation, target: str, access: Access | None = None
) -> Target:
    if target == INPROCESS_TARGET:
        return inprocess_target(engine_config(args), generation)
    if target.startswith(("grpc://", "grpcs://")):
        return grpc_target(args, target, generation, access)
    if target.startswith(("http://", "https://")):
        OpenAIClient(target, args.model, generation)  # validate the URL now
        return AsyncTarget(target, lambda: OpenAIClient(target, args.model, generation, access))
    raise ValueError(
        f"--target is grpc(s)://host:port, http(s)://host:port/v1 or inprocess: {target}"
    )


# ---- several targets, their API key and trusted CAs -----------------------------------------


@dataclass(frozen=True, slots=True)
class TargetSpec:
    """One --target: its label in the tables and its URL (grpc://, http://, ..., inprocess)."""

    label: str
    url: str


def parse_target(text: str) -> TargetSpec:
    """`[LABEL=]URL`. The label is the text before the first '=' when that text holds no '://'
    (so a URL with '=' in its query keeps it); without one the label is the URL."""
    label, equals, url = text.partition("=")
    if not equals or "://" in label:
        label = url = text
    label, url = label.strip(), url.strip()
    if not label:
        raise ValueError(f"--target LABEL=URL needs a label before '=': {text!r}")
    if url != INPROCESS_TARGET and not url.startswith(TARGET_SCHEMES):
        raise ValueError(
            f"--target is [LABEL=]URL with URL grpc(s)://host:port, http(s)://host:port/v1 "
            f"or inprocess: {text!r}"
        )
    return TargetSpec(label, url)


def target_specs(args: argparse.Namespace) -> list[TargetSpec]:
    """The --target flags in order (none: the default target); labels must differ."""
    specs = [parse_target(text) for text in args.target or [DEFAULT_TARGET]]
    labels = [spec.label for spec in specs]
    for label in labels:
        if labels.count(label) > 1:
            raise ValueError(f"--target labels must differ; {label!r} is given twice")
    return specs


def check_target_flags(args: argparse.Namespace, specs: Sequence[TargetSpec]) -> None:
    """ValueError naming the flag that does not fit the targets given."""
    if args.rounds < 1:
        raise ValueError("--rounds must be >= 1")
    if args.rounds > 1 and len(specs) < 2:
        raise ValueError("--rounds alternates several --target: give at least two")
    if args.tls_ca is not None and not any(spec.url.startswith(TLS_SCHEMES) for spec in specs):
        raise ValueError("--tls-ca applies to https:// and grpcs:// targets; none is given")


def api_key_source(args: argparse.Namespace, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """(key, where it came from): --api-key, else the first of API_KEY_VARIABLES set."""
    if args.api_key:
        return args.api_key, "--api-key"
    for name in API_KEY_VARIABLES:
        if environ.get(name):
            return environ[name], name
    return None


def target_access(
    args: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[Access, str | None]:
    """The run's Access and the header line that says what it holds (never the key itself);
    ValueError when the --tls-ca file is missing or holds no certificate."""
    source = api_key_source(args, environ)
    access = Access(
        api_key=None if source is None else source[0],
        tls_ca=None if args.tls_ca is None else Path(args.tls_ca),
    )
    if access.tls_ca is not None:
        try:
            access.ssl_context()  # fails now, not at the first request
        except OSError as exc:  # ssl.SSLError too
            raise ValueError(f"--tls-ca {access.tls_ca}: {exc.strerror or exc}") from exc
    parts = []
    if source is not None:
        parts.append(f"API key from {source[1]} (a bearer token; not shown)")
    if access.tls_ca is not None:
        parts.append(f"TLS: CAs of {access.tls_ca} trusted")
    return access, ("access: " + "; ".join(parts)) if parts else None


def make_targets(
    args: argparse.Namespace,
    generation: Generation,
    specs: Sequence[TargetSpec],
    access: Access,
) -> dict[str, Target]:
    """Every target by label, in the order given; the ones made are closed if one fails."""
    targets: dict[str, Target] = {}
    try:
        for spec in specs:
            targets[spec.label] = make_target(args, generation, spec.url, access)
    except BaseException:
        for target in targets.values():
            target.close()
        raise
    return targets
