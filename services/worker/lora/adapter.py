"""One LoRA adapter in host memory, addressed to the shared decoder's fused projections, and
the checks that it fits the served model.

A target is one part of a projection: q, k or v of qkv_proj, gate or up of gate_up_proj, or
a whole projection (o_proj, down_proj, and the fused checkpoints' qkv_proj / gate_up_proj of
Phi-3). Its delta is scaling * B @ A, A [rank, in] and B [rows of the part, rank]:

    qkv_proj output rows   [ q (heads * head_dim) | k (kv_heads * head_dim) | v (same) ]
    gate_up_proj rows      [ gate (intermediate)  | up (intermediate) ]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from torch import Tensor

from services.worker.lora.errors import LoraAdapterError
from services.worker.model.architecture import ModelArchitecture

QKV = "qkv"
O_PROJ = "o"
GATE_UP = "gate_up"
DOWN = "down"
PROJECTIONS = (QKV, O_PROJ, GATE_UP, DOWN)
"""The decoder's four projections, as the model's hook names them."""

_PARAMETERS = {
    "self_attn.qkv_proj": QKV,
    "self_attn.o_proj": O_PROJ,
    "mlp.gate_up_proj": GATE_UP,
    "mlp.down_proj": DOWN,
}
# (projection, part, num_parts) -> the module name a user knows (PEFT's target_modules).
_MODULE_NAMES = {
    (QKV, 0, 3): "q_proj",
    (QKV, 1, 3): "k_proj",
    (QKV, 2, 3): "v_proj",
    (QKV, 0, 1): "qkv_proj",
    (O_PROJ, 0, 1): "o_proj",
    (GATE_UP, 0, 2): "gate_proj",
    (GATE_UP, 1, 2): "up_proj",
    (GATE_UP, 0, 1): "gate_up_proj",
    (DOWN, 0, 1): "down_proj",
}
SUPPORTED_MODULES = tuple(_MODULE_NAMES.values())


class Target(NamedTuple):
    """Where one A/B pair goes: part `part` of `num_parts` of a layer's projection
    (num_parts 1: the whole projection)."""

    layer: int
    projection: str
    part: int
    num_parts: int

    @property
    def module(self) -> str:
        return _MODULE_NAMES[(self.projection, self.part, self.num_parts)]


def target_of(parameter: str, part: int, num_parts: int) -> Target | None:
    """The target of one of our parameters (`layers.N.self_attn.qkv_proj.weight`, part 0 of
    3); None when it is not a projection's weight (norms, embeddings, the output layer)."""
    layer, dot, rest = parameter.removeprefix("layers.").partition(".")
    if not parameter.startswith("layers.") or not dot or not rest.endswith(".weight"):
        return None
    projection = _PARAMETERS.get(rest.removesuffix(".weight"))
    if projection is None or not layer.isdigit():
        return None
    return Target(int(layer), projection, part, num_parts)


@dataclass(frozen=True, slots=True)
class ProjectionShape:
    in_features: int
    part_sizes: tuple[int, ...]
    """Output rows of each part, in output order."""

    @property
    def out_features(self) -> int:
        return sum(self.part_sizes)

    def rows(self, target: Target) -> tuple[int, int]:
        """[start, end) of the target's rows in the projection's output."""
        if target.num_parts == 1:
            return 0, self.out_features
        start = sum(self.part_sizes[: target.part])
        return start, start + self.part_sizes[target.part]


def projection_shapes(arch: ModelArchitecture) -> dict[str, ProjectionShape]:
    q_size = arch.num_heads * arch.head_dim
    kv_size = arch.num_kv_heads * arch.head_dim
    hidden, intermediate = arch.hidden_size, arch.intermediate_size
    return {
        QKV: ProjectionShape(hidden, (q_size, kv_size, kv_size)),
        O_PROJ: ProjectionShape(q_size, (hidden,)),
        GATE_UP: ProjectionShape(hidden, (intermediate, intermediate)),
        DOWN: ProjectionShape(intermediate, (hidden,)),
    }


@dataclass(slots=True)
class LoraAdapter:
    """An adapter's weights on the host (float32), every target's A [rank, in] and B
    [rows, rank]; layers and parts it does not target are simply absent."""

    name: str
    path: Path
    rank: int
    scaling: float
    """alpha / rank (alpha / sqrt(rank) with rsLoRA): the delta is scaling * B @ A."""
    weights: dict[Target, tuple[Tensor, Tensor]] = field(default_factory=dict)

    @property
    def targets(self) -> tuple[str, ...]:
        """The module names it adapts (q_proj, v_proj, ...), in the decoder's order."""
        modules = {target.module for target in self.weights}
        return tuple(name for name in SUPPORTED_MODULES if name in modules)

    @property
    def num_bytes(self) -> int:
        return sum(
            a.numel() * a.element_size() + b.numel() * b.element_size()
            for a, b in self.weights.values()
        )


def check_adapter(adapter: LoraAdapter, arch: ModelArchitecture, max_rank: int) -> None:
    """Refuse an adapter that does not fit the served model (another base model, a rank over
    the slots' size), naming what differs."""
    if not adapter.weights:
        raise LoraAdapterError("weights", f"adapter {adapter.name!r} has no LoRA weights")
    if adapter.rank > max_rank:
        raise LoraAdapterError(
            "r", f"rank {adapter.rank} is over this worker's max_lora_rank {max_rank}"
        )
    shapes = projection_shapes(arch)
    for target, (a, b) in adapter.weights.items():
        where = f"{target.module} of layer {target.layer}"
        if target.layer >= arch.num_layers:
            raise LoraAdapterError(
                "layers",
                f"{where}: the served model has {arch.num_layers} layers (an adapter of another"
                " base model?)",
            )
        shape = shapes[target.projection]
        if target.num_parts not in (1, len(shape.part_sizes)):
            raise LoraAdapterError("target_modules", f"{where} does not fit the served model")
        start, end = shape.rows(target)
        if a.shape != (adapter.rank, shape.in_features) or b.shape != (end - start, adapter.rank):
            raise LoraAdapterError(
                "shapes",
                f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the"
                f" served model, which needs ({adapter.rank}, {shape.in_features}) and"
                f" ({end - start}, {adapter.rank}) (an adapter of another base model?)",
            )
