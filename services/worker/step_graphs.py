"""Compiled decode steps: the model's forward for pure-decode batches, compiled once per padded
batch size (a bucket) with torch.compile (inductor) and replayed every step.

Why: at small batches an eager decode step is mostly Python dispatching some 600 small torch
ops; a compiled graph fuses the elementwise work (norms, rotary, SiLU-and-mul, residual adds)
into a few C++ loops and calls the matmuls and the C++ paged-attention ops directly.

Shapes are static per bucket. A step of B sequences runs in the smallest bucket >= B; rows
B .. bucket are padding that touches nothing:

    row        input_id  position  slot  context_len  block_table row
    0 .. B-1   real      real      real  real         real (stale entries past the context)
    B .. end   0         0         -1    0            whatever (never read)

The KV write skips slot -1 and attention writes zeros for a context of 0. The block table is
always `max_blocks_per_seq` wide, so a growing context never changes a shape.

A worker with LoRA slots compiles each bucket twice: without adapters, and with them, each row
its own LoRA segment (seg_starts 0, 1, .., bucket) whose slot is the row's adapter, -1 for the
base model and for padding, so the segment table's shapes are the bucket's too. On a CPU the
LoRA apply is the C++ op, opaque in the graph (its Meta function gives dynamo the shapes); a
layer's tables come in as arguments, as its KV cache does, so one graph still serves every
layer (a table indexed by the layer's number would make a graph per layer).

Compiled code is cached on disk by inductor (TORCHINDUCTOR_CACHE_DIR, which the worker points
at inductor/ in llmserve's cache, services/common/cache_files.py), so a second start skips
code generation and the C++ build.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor
from tqdm import tqdm

from kernels import cpu_extension
from services.common.cache_files import cache_root
from services.worker.forward_batch import ForwardBatch
from services.worker.kv_cache import LayerKVCache, PagedKVCache
from services.worker.lora.batch import LoraBatch, LoraLayer
from services.worker.lora.slots import LoraSlots
from services.worker.model.causal_lm import CausalLM

log = logging.getLogger(__name__)

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
CACHE_DIR_ENV_VAR = "TORCHINDUCTOR_CACHE_DIR"


def default_inductor_cache_dir() -> Path:
    return cache_root() / "inductor"


def use_persistent_compile_cache() -> None:
    """Keep inductor's compiled code across restarts (its default lives under /tmp)."""
    os.environ.setdefault(CACHE_DIR_ENV_VAR, str(default_inductor_cache_dir()))


def buckets_up_to(max_num_seqs: int, buckets: Sequence[int] = DEFAULT_BATCH_BUCKETS) -> list[int]:
    """The buckets a scheduler with `max_num_seqs` can fill: every bucket below it, and the
    smallest one that holds it."""
    chosen = [b for b in sorted(buckets) if b < max_num_seqs]
    cover = [b for b in sorted(buckets) if b >= max_num_seqs]
    return chosen + cover[:1] if cover else chosen


@dataclass(slots=True)
class _StaticInputs:
    """The tensors one bucket's graph reads; filled in place every step."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    block_tables: Tensor
    context_lens: Tensor
    lora_seg_slots: Tensor
    """[bucket] int32 each row's LoRA slot (-1: none, padding too); a segment per row."""
    lora_layers: list[LoraLayer]
    """Each layer's LoRA tables over those segments; empty without LoRA slots."""
    batch: ForwardBatch = field(init=False)
    """The tensors above as one decode batch (built once: no allocation per step)."""

    def __post_init__(self) -> None:
        self.batch = ForwardBatch.for_decode(*self.as_args())

    @classmethod
    def empty(
        cls,
        bucket: int,
        max_blocks_per_seq: int,
        device: torch.device,
        lora_slots: LoraSlots | None = None,
    ) -> _StaticInputs:
        def zeros(*shape: int, dtype: torch.dtype) -> Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        lora_seg_slots = torch.full((bucket,), -1, dtype=torch.int32, device=device)
        lora_layers: list[LoraLayer] = []
        if lora_slots is not None:
            seg_starts = torch.arange(bucket + 1, dtype=torch.int32, device=device)
            lora = LoraBatch(seg_starts, lora_seg_slots, lora_slots)
            lora_layers = [lora.layer(index) for index in range(len(lora_slots.layers))]
        return cls(
            input_ids=zeros(bucket, dtype=torch.int64),
            positions=zeros(bucket, dtype=torch.int64),
            slot_mapping=torch.full((bucket,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(bucket, max_blocks_per_seq, dtype=torch.int32),
            context_lens=zeros(bucket, dtype=torch.int32),
            lora_seg_slots=lora_seg_slots,
            lora_layers=lora_layers,
        )

    def fill(self, batch: ForwardBatch) -> int:
        """Copy a decode batch's tensors in (its rows' LoRA slots too, when it has adapter
        rows); reset the padding rows. Returns its size."""
        num_seqs = batch.input_ids.shape[0]
        width = batch.decode_block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.positions[:num_seqs].copy_(batch.positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.block_tables[:num_seqs, :width].copy_(batch.decode_block_tables)
        self.context_lens[:num_seqs].copy_(batch.decode_context_lens)
        if num_seqs < self.input_ids.shape[0]:
            self.input_ids[num_seqs:] = 0
            self.positions[num_seqs:] = 0
            self.slot_mapping[num_seqs:] = -1
            self.context_lens[num_seqs:] = 0
        if batch.lora is not None:
            self.lora_seg_slots[:num_seqs].copy_(batch.lora.row_slots(num_seqs))
            self.lora_seg_slots[num_seqs:] = -1
        return num_seqs

    def as_args(self) -> tuple[Tensor, ...]:
        return (
            self.input_ids,
            self.positions,
            self.slot_mapping,
            self.block_tables,
            self.context_lens,
        )


class DecodeGraphs:
    """One compiled decode forward per bucket; `run` replays the right one."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        *,
        max_model_len: int,
        buckets: Sequence[int],
        lora_slots: LoraSlots | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = sorted(buckets)
        self.max_blocks_per_seq = -(-max_model_len // kv_cache.spec.block_size)
        self.lora_slots = lora_slots
        """The adapter slots whose batches the LoRA graphs run (None: no LoRA graphs)."""
        device = kv_cache.storage.device
        self._inputs = {
            bucket: _StaticInputs.empty(bucket, self.max_blocks_per_seq, device, lora_slots)
            for bucket in self.buckets
        }
        self._compiled: set[int] = set()
        self._compiled_layer: Callable[..., tuple[Tensor, Tensor]] | None = None
        self.num_replays = dict.fromkeys(self.buckets, 0)
        """Steps run by each bucket's graph (for tests and the step profile)."""

    @property
    def max_bucket(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int | None:
        return next((b for b in self.buckets if b >= num_seqs), None)

    def can_run(self, batch: ForwardBatch) -> bool:
        """Pure-decode steps that fit a compiled bucket, their LoRA rows (if any) of the slots
        the graphs were compiled with (prefill and mixed steps run eagerly)."""
        return (
            (batch.lora is None or batch.lora.slots is self.lora_slots)
            and batch.num_prefill_tokens == 0
            and batch.input_ids.shape[0] <= self.max_bucket
            and batch.decode_block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def _forward(
        self,
        compiled_layer: Callable[..., tuple[Tensor, Tensor]],
        inputs: _StaticInputs,
        with_lora: bool,
    ) -> Tensor:
        """The model's decode forward with every decoder layer replaced by the compiled one."""
        model = self.model
        batch = inputs.batch
        hidden = model.embed(batch.input_ids)
        residual: Tensor | None = None
        layers = zip(model.layers, self.kv_cache.layers, strict=True)
        for index, (layer, kv_cache) in enumerate(layers):
            rope = model.layer_rope(index)
            lora = inputs.lora_layers[index] if with_lora else None
            hidden, residual = compiled_layer(layer, hidden, residual, batch, kv_cache, rope, lora)
        assert residual is not None
        return model.logits(hidden, residual)

    @torch.inference_mode()
    def compile_all(self, show_progress: bool = True) -> None:
        """Compile (or load from the disk cache) every bucket's graph, largest first so the
        slowest compile shows up early in the progress bar.

        One decoder layer is compiled, not the whole model: every layer has the same code and
        shapes, so the 30 layers of a step replay one graph (dynamo lifts each layer's weights
        to inputs). Inductor's work, and the first start, shrink by the number of layers; the
        price is one Python call per layer per step.
        """
        if not cpu_extension.load() and self.kv_cache.storage.device.type == "cpu":
            raise RuntimeError("compiled decode steps need the C++ CPU kernels")
        use_persistent_compile_cache()
        self._compiled_layer = _compiled_layer()
        started = time.perf_counter()
        bar = tqdm(
            sorted(self.buckets, reverse=True),
            desc="compiling decode steps",
            unit="bucket",
            disable=not show_progress,
        )
        for bucket in bar:
            bar.set_postfix(batch=bucket)
            # Every row padding: the warm-up call writes no KV and reads none (nor any
            # adapter: every row's LoRA slot is -1).
            self._forward(self._compiled_layer, self._inputs[bucket], with_lora=False)
            if self.lora_slots is not None:
                self._forward(self._compiled_layer, self._inputs[bucket], with_lora=True)
            self._compiled.add(bucket)
        log.info(
            "decode steps compiled",
            extra={
                "buckets": ",".join(map(str, self.buckets)),
                "seconds": round(time.perf_counter() - started, 1),
            },
        )

    @property
    def is_compiled(self) -> bool:
        return len(self._compiled) == len(self.buckets)

    def run(self, batch: ForwardBatch) -> Tensor:
        """Logits [B, vocab] (fp32) of a pure-decode batch of B sequences."""
        bucket = self.bucket_for(batch.input_ids.shape[0])
        assert bucket is not None and bucket in self._compiled, "call compile_all() first"
        inputs = self._inputs[bucket]
        num_seqs = inputs.fill(batch)
        self.num_replays[bucket] += 1
        # The inputs of a bucket never change shape or dtype, so dynamo's guards only pick
        # the bucket's entry; skip re-checking everything else on every step.
        assert self._compiled_layer is not None
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            logits = self._forward(self._compiled_layer, inputs, batch.lora is not None)
        return logits[:num_seqs]


# Dynamo keeps one cache of compiled graphs per function: an entry per (bucket, first layer or
# not, weight format, LoRA or not). Engines built on the same model in one process (benchmarks,
# tests) reuse the entries. Past the limit dynamo would quietly run the layer eagerly; fail
# instead.
@functools.cache
def _compiled_layer() -> Callable[..., tuple[Tensor, Tensor]]:
    torch._dynamo.config.recompile_limit = 256
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    return torch.compile(_run_layer, fullgraph=True, dynamic=False)


def _run_layer(
    layer: torch.nn.Module,
    hidden: Tensor,
    residual: Tensor | None,
    batch: ForwardBatch,
    kv_cache: LayerKVCache,
    rope: Tensor,
    lora: LoraLayer | None,
) -> tuple[Tensor, Tensor]:
    return layer(hidden, residual, batch, kv_cache, rope, lora)  # type: ignore[no-any-return]
