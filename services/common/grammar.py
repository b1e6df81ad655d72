"""Structured-output specs compiled with xgrammar, for the model's vocabulary; used by the
tokenizer tier (to refuse a bad spec before it reaches a scheduler) and by the worker (to
build the matchers that mask each step's logits).

xgrammar is imported on first use, never at module import: its Python package imports torch
(and transformers), which a tokenizer replica that never sees a structured request does
without. A compile releases the GIL, so callers run it on a thread without stalling the
event loop (tokenizer tier) or the forward thread (worker).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import replace
from typing import Any

from tokenizers import Tokenizer

from services.contracts.errors import InvalidRequestError, shortened
from services.contracts.model_description import ModelDescription
from services.contracts.structured_output import StructuredOutput, StructuredOutputKind

MAX_ERROR_CHARS = 300
"""xgrammar's messages quote the input; a status message quotes at most this much of it."""

DEFAULT_CACHE_SIZE = 128
"""Compiled specs kept (a JSON schema's compiled grammar is some 100 KB to a few MB)."""

# "[01:09:02] /project/cpp/regex_converter.cc:83: " and "Check failed: (x) is false: "
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")


def xgrammar_message(exc: BaseException) -> str:
    """xgrammar's error without its source location, cut to MAX_ERROR_CHARS."""
    text = str(exc).strip()
    text = _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text))
    text = text.split(" The JSON string is:", 1)[0]  # would echo the whole schema back
    return shortened(" ".join(text.split()), MAX_ERROR_CHARS)


def tokenizer_info(tokenizer: Tokenizer, vocab_size: int, stop_token_ids: Sequence[int]) -> Any:
    """xgrammar's view of the vocabulary (an `xgrammar.TokenizerInfo`).

    `vocab_size` is the model's (the logits' width): ids past the tokenizer's are never
    allowed. Special tokens (chat markers, <|endoftext|>) are given as empty strings, which
    xgrammar never allows inside the output: the detokenizer drops them, so text they spelled
    would be missing from what the client reads. The stop ids (the model's EOS) are allowed
    once the output is complete.
    """
    import xgrammar as xgr

    encoded = [""] * vocab_size
    for token, index in tokenizer.get_vocab(with_added_tokens=True).items():
        if index < vocab_size:
            encoded[index] = token
    for index, added in tokenizer.get_added_tokens_decoder().items():
        if added.special and index < vocab_size:
            encoded[index] = ""
    # What TokenizerInfo.from_huggingface does with a fast tokenizer's backend JSON, which is
    # exactly what this tokenizer is: byte-level or byte-fallback, and the prefix space.
    metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer.to_str())
    return xgr.TokenizerInfo(
        encoded,
        metadata["vocab_type"],
        vocab_size=vocab_size,
        stop_token_ids=list(stop_token_ids),
        add_prefix_space=metadata["add_prefix_space"],
    )


class GrammarCompiler:
    """Compiles specs for one model's vocabulary, once per distinct spec (thread-safe: callers
    asking for a spec being compiled wait for that compile). Failures are cached too, so a bad
    schema sent again costs nothing."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        *,
        max_threads: int = 1,
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        self._max_threads = max_threads
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._compiler: Any = None
        self._cache: OrderedDict[StructuredOutput, Future[Any]] = OrderedDict()
        self.num_compiles = 0
        """Compiles actually run (cache misses), for tests and metrics."""

    @classmethod
    def from_description(cls, description: ModelDescription, **kwargs: Any) -> GrammarCompiler:
        return cls(
            description.tokenizer_json,
            description.vocab_size,
            description.eos_token_ids,
            **kwargs,
        )

    def compile(self, spec: StructuredOutput) -> Any:
        """The `xgrammar.CompiledGrammar` of `spec`; blocks while it compiles. Raises
        InvalidRequestError(spec.field, xgrammar's reason) when it does not compile."""
        # Where the grammar starts (starts_after) is the matcher's business, not the compile's.
        spec = replace(spec, starts_after=())
        with self._lock:
            future = self._cache.get(spec)
            owner = future is None
            if future is None:
                future = self._cache[spec] = Future()
                while len(self._cache) > self._cache_size:
                    oldest = next(iter(self._cache))
                    if not self._cache[oldest].done():
                        break
                    del self._cache[oldest]
            else:
                self._cache.move_to_end(spec)
        if owner:
            try:
                future.set_result(self._compile(spec))
            except BaseException as exc:
                future.set_exception(exc)
        return future.result()

    def is_compiled(self, spec: StructuredOutput) -> bool:
        """Compiled (successfully) and still cached: a matcher can be built without waiting."""
        spec = replace(spec, starts_after=())
        with self._lock:
            future = self._cache.get(spec)
        return future is not None and future.done() and future.exception() is None

    def _xgrammar_compiler(self) -> Any:
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr

                info = tokenizer_info(
                    Tokenizer.from_str(self._tokenizer_json), self.vocab_size, self.stop_token_ids
                )
                # Our own cache (above) keys by spec and holds failures too; xgrammar's would
                # keep a second copy of every compiled grammar.
                self._compiler = xgr.GrammarCompiler(
                    info, max_threads=self._max_threads, cache_enabled=False
                )
            return self._compiler

    def _compile(self, spec: StructuredOutput) -> Any:
        spec.validate()
        if spec.kind is StructuredOutputKind.JSON_SCHEMA:
            try:
                schema = json.loads(spec.text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(spec.field, f"is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(spec.field, "must be a JSON object (a JSON Schema)")
        compiler = self._xgrammar_compiler()
        self.num_compiles += 1
        try:
            if spec.kind is StructuredOutputKind.JSON_SCHEMA:
                # Compact JSON (no free whitespace between tokens): a small model given the
                # choice pads with newlines until max_new_tokens.
                return compiler.compile_json_schema(spec.text, any_whitespace=False)
            if spec.kind is StructuredOutputKind.JSON_OBJECT:
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=False, strict_mode=False
                )
            if spec.kind is StructuredOutputKind.REGEX:
                return compiler.compile_regex(spec.text)
            if spec.kind is StructuredOutputKind.STRUCTURAL_TAG:
                return compiler.compile_structural_tag(spec.text)
            return compiler.compile_grammar(spec.text)
        except (RuntimeError, ValueError) as exc:
            raise InvalidRequestError(spec.field, xgrammar_message(exc)) from None
