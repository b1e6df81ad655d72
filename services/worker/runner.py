"""The model runner: plan in, sampled tokens out. Owns the model, the KV cache, the persistent
batch and the sampler; knows nothing of scheduling or text."""

from __future__ import annotations

from typing import Literal, Protocol

import torch

from services.common.grammar import GrammarCompiler
from services.common.serving_config import DEFAULT_KV_GROUP_SIZE
from services.contracts.step import BatchPlan, StepResult
from services.worker.batch_invariance import make_batch_invariant
from services.worker.config import GiB
from services.worker.forward_batch import ForwardBatch
from services.worker.fused_decode import FusedDecode
from services.worker.host_memory import keep_freed_memory
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.kv_disk_steps import KvDiskSteps
from services.worker.loaded_model import LoadedModel
from services.worker.lora.adapters import LoraAdapters
from services.worker.model.causal_lm import CausalLM
from services.worker.python_gc import freeze_loaded_objects
from services.worker.quantization.formats import check_kv_cache_group_size
from services.worker.sampler import Sampler
from services.worker.sampling_metadata import build_sampling_metadata
from services.worker.speculative.suffix_cache import SuffixCache
from services.worker.speculative.verify_step import sample_and_verify
from services.worker.step_graphs import DEFAULT_BATCH_BUCKETS, DecodeGraphs, buckets_up_to
from services.worker.structured_output.matchers import GrammarMatchers

StepMode = Literal["fused", "compiled", "eager"]


class RunnerSettings(Protocol):
    """The config fields a runner is made from: the shared groups (DeviceConfig,
    WeightsConfig, BatchingConfig, RuntimeConfig, SpeculationConfig) the worker's and the
    in-process engine's configs both have."""

    kv_cache_gib: float
    block_size: int
    seed: int | None
    kv_cache_dtype: str
    kv_cache_group_size: int
    enforce_eager: bool
    max_num_seqs: int
    fused_decode: bool
    deterministic: bool | None
    speculative_ngram_min_n: int
    speculative_ngram_max_n: int
    speculative_suffix_min_prob: float
    max_loras: int
    max_lora_rank: int
    max_cpu_loras: int
    lora_modules: tuple[str, ...]

    @property
    def suffix_cache_tokens(self) -> int:
        """The suffix cache's budget as served (0 under --no-speculation)."""
        ...


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        eos_token_ids: tuple[int, ...],
        seed: int | None = None,
        decode_graphs: DecodeGraphs | None = None,
        fused_decode: FusedDecode | None = None,
        batch_invariant: bool = False,
        grammar_compiler: GrammarCompiler | None = None,
        ngram_sizes: tuple[int, int] = (2, 4),
        adapters: LoraAdapters | None = None,
        suffix_cache: SuffixCache | None = None,
        kv_disk: KvDiskSteps | None = None,
    ) -> None:
        if kv_cache.storage.device.type == "cpu":
            keep_freed_memory()
        self.decode_graphs = decode_graphs
        self.fused_decode = fused_decode
        self.last_step_mode: StepMode = "eager"
        """How the last forward ran: a fused C++ decode, a compiled graph, or eager torch ops
        (for metrics)."""
        self.model = model
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = kv_cache.storage.device
        self.batch_invariant = batch_invariant
        """Each sequence's logits depend only on its own tokens, not on what it is batched
        with; set up by services/worker/batch_invariance.py."""
        self.ngram_sizes = ngram_sizes
        """(min n, max n) of prompt lookup's matches, for the drafts plans ask for."""
        self.suffix_cache = suffix_cache
        """Suffix decoding's recent text (None: off); kept across resets, as the text it
        holds stays good to draft from."""
        self.sampled_drafts = seed is None
        """Sampled sequences may draft only where no --seed makes their draws repeatable."""
        self.kv_disk = kv_disk
        """The KV disk tier's step hook (None: --kv-disk-dir unset, or the tier is off)."""
        self.batch = self._new_batch()
        self.sampler = Sampler(seed=seed)
        self.vocab_size = model.architecture.vocab_size
        self.grammars = GrammarMatchers(grammar_compiler) if grammar_compiler else None
        """Structured output's matchers (None: a runner without a tokenizer, which refuses
        nothing and constrains nothing)."""
        self.adapters = adapters or LoraAdapters(
            model.architecture,
            model.norm.dtype,
            self.device,
            max_loras=0,
            max_lora_rank=1,
            max_cpu_loras=0,
        )
        """LoRA adapters: loaded by name, resolved per new sequence, applied per row."""
        freeze_loaded_objects()

    @classmethod
    def create(
        cls,
        loaded: LoadedModel,
        *,
        kv_cache_bytes: int,
        block_size: int,
        seed: int | None,
        kv_cache_dtype: str = "auto",
        kv_cache_group_size: int = DEFAULT_KV_GROUP_SIZE,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        max_num_seqs: int = DEFAULT_BATCH_BUCKETS[-1],
        fused_decode: bool = True,
        batch_invariant: bool | None = False,
        ngram_sizes: tuple[int, int] = (2, 4),
        suffix_cache_tokens: int = 0,
        suffix_min_prob: float = 0.1,
        max_loras: int = 0,
        max_lora_rank: int = 16,
        max_cpu_loras: int = 0,
        lora_graphs: bool = False,
    ) -> ModelRunner:
        """A runner with a KV cache of as many blocks as `kv_cache_bytes` holds (an int8 cache
        holds more: its blocks are smaller).

        Pure-decode steps run, in order of preference: fused in C++ (`fused_decode`, for the
        models services/worker/fused_decode.py supports: GGUF blocks on a CPU, any float dtype);
        else, unless `enforce_eager`, compiled graphs for up to `max_num_seqs` sequences (call
        `compile_step_graphs()` before serving); else eagerly.

        `batch_invariant`: batch-invariant layers and attention (the --deterministic flag,
        services/worker/batch_invariance.py). Every step then takes one path, so that a token
        never depends on whether its step held a prefill: the fused C++ layers where the
        model's projections are GGUF blocks with int8 activations (each token attending as a
        decode query), else eager ops (no compiled decode). None: on where it is free (the
        fused case), off elsewhere.

        `max_loras` device slots hold LoRA adapters of up to `max_lora_rank`, `max_cpu_loras`
        stay in host memory (services/worker/lora/). Decode steps with adapter rows take the
        fused path too; compiled graphs add adapters only with `lora_graphs` (the slots are
        then allocated now, and each bucket compiles a second graph: a start that doubles its
        compile time is paid only by a worker given adapters at start; adapters loaded later
        into a worker without them decode eagerly)."""
        spec = KVCacheSpec.for_model(
            loaded.model.architecture,
            block_size,
            loaded.kv_cache_dtype(kv_cache_dtype),
            check_kv_cache_group_size(kv_cache_group_size),
        )
        kv_cache = PagedKVCache(spec, spec.num_blocks_for_budget(kv_cache_bytes), loaded.device)
        fused = FusedDecode.for_model(loaded.model, kv_cache) if fused_decode else None
        fused_invariant = fused is not None and fused.is_batch_invariant()
        if batch_invariant is None:
            batch_invariant = fused_invariant
        if batch_invariant:
            make_batch_invariant(loaded.model)
            if not fused_invariant:
                fused = None
        adapters = LoraAdapters(
            loaded.model.architecture,
            loaded.dtype,
            loaded.device,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max(max_cpu_loras, max_loras),
        )
        decode_graphs = None
        if fused is None and not enforce_eager and not batch_invariant:
            decode_graphs = DecodeGraphs(
                loaded.model,
                kv_cache,
                max_model_len=loaded.max_model_len(max_model_len),
                buckets=buckets_up_to(max_num_seqs),
                lora_slots=adapters.allocate_slots() if max_loras and lora_graphs else None,
            )
        return cls(
            loaded.model,
            kv_cache,
            eos_token_ids=loaded.eos_token_ids,
            seed=seed,
            decode_graphs=decode_graphs,
            fused_decode=fused,
            batch_invariant=batch_invariant,
            ngram_sizes=ngram_sizes,
            adapters=adapters,
            suffix_cache=(
                SuffixCache(suffix_cache_tokens, suffix_min_prob) if suffix_cache_tokens else None
            ),
            grammar_compiler=GrammarCompiler(
                loaded.tokenizer.tokenizer.to_str(),
                loaded.model.architecture.vocab_size,
                loaded.eos_token_ids,
            ),
        )

    @classmethod
    def from_settings(
        cls, loaded: LoadedModel, settings: RunnerSettings, max_model_len: int | None
    ) -> ModelRunner:
        """`create` with a config's fields (the KV cache's size in GiB)."""
        return cls.create(
            loaded,
            kv_cache_bytes=int(settings.kv_cache_gib * GiB),
            block_size=settings.block_size,
            seed=settings.seed,
            kv_cache_dtype=settings.kv_cache_dtype,
            kv_cache_group_size=settings.kv_cache_group_size,
            enforce_eager=settings.enforce_eager,
            max_model_len=max_model_len,
            max_num_seqs=settings.max_num_seqs,
            fused_decode=settings.fused_decode,
            batch_invariant=settings.deterministic,
            ngram_sizes=(settings.speculative_ngram_min_n, settings.speculative_ngram_max_n),
            suffix_cache_tokens=settings.suffix_cache_tokens,
            suffix_min_prob=settings.speculative_suffix_min_prob,
            max_loras=settings.max_loras,
            max_lora_rank=settings.max_lora_rank,
            max_cpu_loras=settings.max_cpu_loras,
            lora_graphs=bool(settings.lora_modules),
        )

    def compile_step_graphs(self, show_progress: bool = True) -> None:
        """Build the C++ kernels and compile every decode bucket (from the disk cache when a
        previous start compiled them); a no-op when running eagerly."""
        if self.device.type == "cpu":
            from kernels import cpu_extension

            cpu_extension.load()
        if self.decode_graphs is not None and not self.decode_graphs.is_compiled:
            self.decode_graphs.compile_all(show_progress)

    def reset(self) -> None:
        """Forget every sequence (a new scheduler session); the KV bytes are simply reused."""
        self.batch = self._new_batch()
        if self.grammars is not None:
            self.grammars.clear()
        self.adapters.reset()

    def _new_batch(self) -> InputBatch:
        return InputBatch(
            self.kv_cache.spec.block_size,
            self.device,
            per_token_attention=self.batch_invariant,
            ngram_sizes=self.ngram_sizes,
            suffix_cache=self.suffix_cache,
            sampled_drafts=self.sampled_drafts,
        )

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        # A sequence whose adapter cannot be served fails alone, and is left out of the plan.
        plan, failed = self.adapters.admit(plan)
        if self.kv_disk is not None:
            plan, disk_failed = self.kv_disk.admit(plan, self.kv_cache)
            failed.update(disk_failed)
        self.batch.apply(plan)
        grammars = self.grammars
        if grammars is not None:
            grammars.apply(plan)
        self.kv_cache.copy_blocks(plan.block_copies)
        result = StepResult(step_id=plan.step_id, failed_sequences=failed)
        if self.kv_disk is not None:
            self.kv_disk.report(result)
        self.last_step_mode = "eager"
        if plan.is_empty:
            return result
        drafts, proposers = self.batch.propose_drafts(plan) if plan.draft_slots else ({}, {})
        if drafts and grammars is not None:
            drafts = grammars.cut_drafts(drafts)
        inputs = self.batch.prepare(plan, drafts)
        if self.adapters.num_running:
            inputs.forward.lora = self.adapters.batch_for(
                [seq.request_id for seq in inputs.sequences], inputs.row_counts, self.device
            )
        sampled: dict[str, int] = {}
        accepted: dict[str, list[int]] = {}
        if drafts:
            logits = self._forward_sampled(inputs.forward)
            sampled, accepted = sample_and_verify(
                logits,
                inputs,
                self.batch.sequences,
                self.sampler,
                self.eos_token_ids,
                self.vocab_size,
                self.grammars,
            )
            result.num_proposed_drafts = {rid: len(d) for rid, d in drafts.items()}
            result.draft_proposers = {rid: proposers[rid] for rid in drafts}
            result.accepted_draft_ids = {rid: ids for rid, ids in accepted.items() if ids}
        elif inputs.sampled_request_ids:
            logits = self._forward_sampled(inputs.forward)
            rows = [
                self.batch.sequences[rid].sampler_row(self.eos_token_ids)
                for rid in inputs.sampled_request_ids
            ]
            metadata = build_sampling_metadata(rows, self.vocab_size, self.device)
            if grammars is not None:
                # Every decode path (fused C++, compiled graph, eager) ends in these logits.
                metadata.grammar_mask = grammars.fill(inputs.sampled_request_ids)
            output = self.sampler(logits, metadata)
            token_ids = output.token_ids.tolist()
            sampled = dict(zip(inputs.sampled_request_ids, token_ids, strict=True))
            for request_id, logprobs in zip(
                inputs.sampled_request_ids, output.logprobs, strict=True
            ):
                if logprobs is not None:
                    result.logprobs[request_id] = logprobs
        else:
            # Only partial prefill chunks this step: fill the cache, skip the vocabulary.
            fused = self.fused_decode
            if fused is not None and fused.can_run(inputs.forward):
                self.last_step_mode = "fused"
                fused.run(inputs.forward, with_logits=False)
            else:
                self.model(inputs.forward, self.kv_cache.layers)
        self.batch.advance(plan, sampled, accepted)
        if grammars is not None:
            grammars.accept(sampled, accepted)
        result.sampled_token_ids = sampled
        return result

    def _forward_sampled(self, forward: ForwardBatch) -> torch.Tensor:
        """Logits of a step that samples, by the fastest path that can run it."""
        fused, graphs = self.fused_decode, self.decode_graphs
        if fused is not None and fused.can_run(forward):
            self.last_step_mode = "fused"
            return fused.run(forward)
        if graphs is not None and graphs.is_compiled and graphs.can_run(forward):
            self.last_step_mode = "compiled"
            return graphs.run(forward)
        return self.model(forward, self.kv_cache.layers)
