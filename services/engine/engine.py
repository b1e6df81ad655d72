"""The in-process engine: scheduler + model runner in one loop. Tests, benchmarks and offline
inference use it directly; the scheduler service wraps the same pieces across processes.

    engine = LLMEngine(EngineConfig())
    rid = engine.add_request(prompt_token_ids, SamplingParams(max_new_tokens=32))
    while engine.has_unfinished_requests():
        for event in engine.step(): ...
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.common.prefix_hash import adapter_salt
from services.common.prompt_checks import check_prompt_length, check_token_ids
from services.contracts.errors import InvalidRequestError, NotFoundError
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import FinishReason, TokenEvent, TokenLogprobs
from services.contracts.usage import Usage
from services.engine.config import EngineConfig
from services.scheduler.config import SchedulerConfig
from services.scheduler.request import Request
from services.scheduler.scheduler import Scheduler
from services.scheduler.stats import SchedulerStats
from services.text.builtin_chat_templates import chat_template_option
from services.worker.config import resolve_dtype
from services.worker.kv_disk_steps import KvDiskSteps
from services.worker.kv_transfer import CacheIdentity
from services.worker.loaded_model import LoadedModel
from services.worker.quantization.formats import serves_gguf_blocks
from services.worker.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GenerationResult:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage = field(default_factory=Usage)
    logprobs: list[TokenLogprobs] = field(default_factory=list)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loaded: LoadedModel | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Load the model (unless `loaded` is given: its dtype and device win) and size the KV
        cache from config.kv_cache_gib."""
        self.config = config = config or EngineConfig()
        self.clock = clock
        if config.threads:
            torch.set_num_threads(config.threads)
        if loaded is None:
            gguf_blocks = serves_gguf_blocks(config.quantization, config.model)
            dtype = resolve_dtype(config.dtype, config.device, gguf_blocks=gguf_blocks)
            loaded = LoadedModel.load(
                config.model, dtype, config.device, config.quantization, config.max_model_len
            )
        self.loaded = loaded
        self.model_name = loaded.name
        self.tokenizer = loaded.tokenizer
        if config.chat_template:
            source = chat_template_option(config.chat_template)
            self.tokenizer = loaded.tokenizer.with_chat_template(source)
        self.model = loaded.model
        self.dtype = loaded.dtype
        self.architecture = self.model.architecture
        self.max_model_len = loaded.max_model_len(config.max_model_len)
        self.eos_token_ids = loaded.eos_token_ids
        self.runner = ModelRunner.from_settings(loaded, config, self.max_model_len)
        self.runner.compile_step_graphs()
        for name, path in config.lora_module_paths().items():
            self.runner.adapters.load(name, Path(path))
        self.kv_cache = self.runner.kv_cache
        if config.kv_disk_dir:
            self.runner.kv_disk = KvDiskSteps.open(
                Path(config.kv_disk_dir),
                config.kv_disk_gib,
                loaded.path,
                f"{loaded.quantization}:{str(loaded.dtype).removeprefix('torch.')}",
                CacheIdentity.of(loaded.name, self.kv_cache),
            )
        self.num_kv_blocks = self.kv_cache.num_blocks
        self.scheduler = Scheduler(
            SchedulerConfig(
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=config.enable_prefix_caching,
                allocation_policy=config.allocation_policy,
                max_waiting_requests=config.max_waiting_requests,
                speculation=config.speculation is not False,
                speculative_ngram=config.default_draft_limit(self.runner.batch_invariant),
                debug_checks=config.debug_checks,
            ),
            self.num_kv_blocks,
            sliding_window=self.architecture.largest_window,
            max_loras=self.runner.adapters.max_loras,
            kv_disk_hashes=self.runner.kv_disk.tier.hashes() if self.runner.kv_disk else None,
        )
        self._ids = itertools.count()
        log.info(
            "engine ready",
            extra={
                "model": self.model_name,
                "dtype": str(self.dtype),
                "kv_blocks": self.num_kv_blocks,
                "max_model_len": self.max_model_len,
            },
        )

    # ---- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams | None = None,
        *,
        request_id: str | None = None,
        deadline_s: float | None = None,
        lora_name: str = "",
    ) -> str:
        """Queue a request; returns its id. `lora_name`: a loaded LoRA adapter ("" = the base
        model). Raises InvalidRequestError naming the bad field, NotFoundError for an adapter
        not loaded, CapacityError if it can never fit, QueueFullError if the queue is full."""
        sampling = sampling or SamplingParams()
        prompt = self.validate_prompt(prompt_token_ids)
        sampling.validate(
            max_new_tokens_limit=self.max_model_len, vocab_size=self.architecture.vocab_size
        )
        if deadline_s is not None and not deadline_s > 0:
            raise InvalidRequestError("deadline_ms", f"must be > 0, got {deadline_s * 1000}")
        if lora_name and lora_name not in self.runner.adapters.names:
            raise NotFoundError("model", f"no LoRA adapter {lora_name!r} is loaded")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        now = self.clock()
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=prompt,
                sampling=sampling,
                eos_token_ids=self.eos_token_ids,
                arrival_time=now,
                deadline=None if deadline_s is None else now + deadline_s,
                cache_salt=adapter_salt(b"", lora_name),
                lora_name=lora_name,
            )
        )
        return request_id

    def validate_prompt(self, prompt_token_ids: Sequence[int]) -> list[int]:
        prompt = [int(t) for t in prompt_token_ids]
        check_prompt_length(len(prompt), self.max_model_len)
        check_token_ids("prompt_token_ids", prompt, self.architecture.vocab_size)
        return prompt

    def abort(self, request_id: str) -> None:
        self.scheduler.abort_request(request_id)

    # ---- the loop -----------------------------------------------------------------------

    def step(self) -> list[TokenEvent]:
        """One scheduler step and one forward; returns what happened to each request."""
        plan = self.scheduler.schedule(self.clock())
        started = time.perf_counter()
        result = self.runner.execute(plan)
        self.scheduler.observe_step(plan, result, time.perf_counter() - started)
        return self.scheduler.update(plan, result, self.clock())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stream(self) -> Iterator[TokenEvent]:
        """Step until every queued request has finished, yielding events as they come."""
        while self.has_unfinished_requests():
            yield from self.step()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    # ---- offline convenience ------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int] | str],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        on_finish: Callable[[GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every prompt to completion with continuous batching; results in input order.
        One completion per prompt: for n > 1, add_request() and read the events' `index`."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        if any(params.n != 1 for params in sampling):
            raise InvalidRequestError(
                "n", "generate() returns one completion per prompt; use add_request() for n > 1"
            )
        results: dict[str, GenerationResult] = {}
        order: list[str] = []
        for prompt, params in zip(prompts, sampling, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = self.add_request(ids, params)
            results[request_id] = GenerationResult(request_id, ids)
            order.append(request_id)
        for event in self.stream():
            result = results.get(event.request_id)
            if result is None:
                continue
            result.token_ids.extend(event.new_token_ids)
            result.logprobs.extend(event.logprobs)
            if event.finish_reason is not None:
                result.finish_reason = event.finish_reason
                result.usage = Usage(
                    len(result.prompt_token_ids), len(result.token_ids), event.num_cached_tokens
                )
                result.text = self.tokenizer.decode(result.token_ids)
                if on_finish is not None:
                    on_finish(result)
        return [results[request_id] for request_id in order]
