"""Weights and tokenizer of one model, loaded once; engines, workers, tests and benchmarks
share the same object."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.model_source import model_display_name, resolve_model_path
from services.contracts.model_description import ModelDescription
from services.text.model_tokenizer import ModelTokenizer
from services.worker.loader.model_loader import load_model
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.formats import kv_cache_torch_dtype, resolve_quantization


@dataclass(frozen=True, slots=True)
class LoadedModel:
    path: Path
    model: CausalLM
    tokenizer: ModelTokenizer
    quantization: str = "none"
    """The weight format the layers were swapped to at load (--quantization, auto resolved)."""

    @classmethod
    def load(
        cls,
        model: str | None,
        dtype: torch.dtype,
        device: str = "cpu",
        quantization: str = "none",
        max_model_len: int | None = None,
    ) -> LoadedModel:
        """`max_model_len`: the longest sequence served (unset: the model's context); the rope
        tables are sized by it."""
        path = resolve_model_path(model)
        tokenizer = ModelTokenizer.from_path(path)
        network = load_model(
            path,
            dtype=dtype,
            device=device,
            quantization=quantization,
            max_positions=max_model_len,
        )
        return cls(path, network, tokenizer, resolve_quantization(quantization, path))

    @property
    def name(self) -> str:
        return model_display_name(self.path)

    @property
    def dtype(self) -> torch.dtype:
        """Activations and float weights (the final norm is never quantized)."""
        return self.model.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.device

    def kv_cache_dtype(self, kv_cache_dtype: str) -> torch.dtype:
        """The KV cache element type a --kv-cache-dtype value gives this model: `auto` follows
        its dtype, its weight format and its device (formats.kv_cache_torch_dtype)."""
        return kv_cache_torch_dtype(
            kv_cache_dtype, self.dtype, quantization=self.quantization, device=str(self.device)
        )

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The model config's EOS ids and the tokenizer's (chat models end turns with theirs)."""
        ids = (*self.model.architecture.eos_token_ids, *self.tokenizer.eos_token_ids)
        return tuple(dict.fromkeys(ids))

    def max_model_len(self, limit: int | None = None) -> int:
        context = self.model.architecture.max_position_embeddings
        return min(limit or context, context)

    def describe(self, max_model_len_limit: int | None = None) -> ModelDescription:
        """The facts the tokenizer tier serves the model with (its tokenizer included)."""
        return self.tokenizer.describe(
            model_name=self.name,
            vocab_size=self.model.architecture.vocab_size,
            max_model_len=self.max_model_len(max_model_len_limit),
            eos_token_ids=self.model.architecture.eos_token_ids,
        )
