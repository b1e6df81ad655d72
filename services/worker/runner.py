"""The model runner: plan in, sampled tokens out. Owns the model, the KV cache, the persistent
batch and the sampler; knows nothing of scheduling or text."""

from __future__ import annotations

import torch

from services.scheduler.plan import BatchPlan, StepResult
from services.worker.host_memory import keep_freed_memory
from services.worker.input_batch import InputBatch
from services.worker.kv_cache import KVCacheSpec, PagedKVCache
from services.worker.loaded_model import LoadedModel
from services.worker.model.llama import LlamaForCausalLM
from services.worker.quantization.formats import (
    DEFAULT_KV_GROUP_SIZE,
    check_kv_cache_group_size,
    kv_cache_torch_dtype,
)
from services.worker.sampler import Sampler, build_sampling_metadata


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: PagedKVCache,
        *,
        eos_token_ids: tuple[int, ...],
        seed: int | None = None,
    ) -> None:
        if kv_cache.storage.device.type == "cpu":
            keep_freed_memory()
        self.model = model
        self.kv_cache = kv_cache
        self.eos_token_ids = eos_token_ids
        self.device = kv_cache.storage.device
        self.batch = InputBatch(kv_cache.spec.block_size, self.device)
        self.sampler = Sampler(seed=seed)
        self.vocab_size = model.config.vocab_size

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
    ) -> ModelRunner:
        """A runner with a KV cache of as many blocks as `kv_cache_bytes` holds (an int8 cache
        holds more: its blocks are smaller)."""
        spec = KVCacheSpec.for_model(
            loaded.model.config,
            block_size,
            kv_cache_torch_dtype(kv_cache_dtype, loaded.dtype),
            check_kv_cache_group_size(kv_cache_group_size),
        )
        kv_cache = PagedKVCache(spec, spec.num_blocks_for_budget(kv_cache_bytes), loaded.device)
        return cls(loaded.model, kv_cache, eos_token_ids=loaded.eos_token_ids, seed=seed)

    def reset(self) -> None:
        """Forget every sequence (a new scheduler session); the KV bytes are simply reused."""
        self.batch = InputBatch(self.kv_cache.spec.block_size, self.device)

    @torch.inference_mode()
    def execute(self, plan: BatchPlan) -> StepResult:
        self.batch.apply(plan)
        self.kv_cache.copy_blocks(plan.block_copies)
        result = StepResult(step_id=plan.step_id)
        if plan.is_empty:
            return result
        inputs = self.batch.prepare(plan)
        sampled: dict[str, int] = {}
        if inputs.sampled_ids:
            logits = self.model(inputs.forward, self.kv_cache.layers)
            rows = [
                self.batch.sequences[rid].sampler_row(self.eos_token_ids)
                for rid in inputs.sampled_ids
            ]
            metadata = build_sampling_metadata(rows, self.vocab_size, self.device)
            output = self.sampler(logits, metadata)
            token_ids = output.token_ids.tolist()
            sampled = dict(zip(inputs.sampled_ids, token_ids, strict=True))
            for request_id, logprobs in zip(inputs.sampled_ids, output.logprobs, strict=True):
                if logprobs is not None:
                    result.logprobs[request_id] = logprobs
        else:
            # Only partial prefill chunks this step: fill the cache, skip the vocabulary.
            self.model(inputs.forward, self.kv_cache.layers)
        self.batch.advance(plan, sampled)
        result.sampled_token_ids = sampled
        return result
