"""What a model file is and whether llmserve serves it, from its metadata alone (a GGUF file's
header, a Hugging Face directory's JSON files and safetensors headers): no weights are read
and torch is never imported. `llmserve inspect` (services/inspect_command.py) prints it.

The verdict collects every refusal the worker would raise at load (the family registry, the
weight names, the tensor types, the tokenizer). The weight-memory estimate follows what the
worker does with each tensor under --quantization auto (services/worker/quantization/
gguf_direct.py for a GGUF file, the model dtype for a Hugging Face directory).
"""

from __future__ import annotations

import functools
import json
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from services.common.gguf_index import open_gguf_index
from services.common.gguf_metadata import field_value, open_gguf
from services.common.model_source import model_display_name
from services.contracts.errors import LLMServeError, ModelLoadError
from services.text.builtin_chat_templates import builtin_for_model
from services.text.model_tokenizer import ModelTokenizer
from services.worker.loader.weight_names import PartName, gguf_part, hf_part
from services.worker.model.architecture import ModelArchitecture, RopeConfig
from services.worker.model.architecture_switches import architecture_switches
from services.worker.model.families import (
    gguf_model_architecture,
    hf_model_architecture,
)
from services.worker.model.families.base import ModelFamily

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
"""The dtypes the estimate is given for (float16 takes bfloat16's bytes)."""

# What the worker does with a tensor at load (--quantization auto).
STORED_BLOCKS = "stored blocks"
INT8_ROWS = "int8 per row"
DEQUANTIZED = "dequantized to the model dtype"
MODEL_DTYPE = "model dtype"
SHARED_WITH_EMBEDDING = "shared with the embedding"
ROPE_SETTINGS = "read as rope settings"
NOT_LOADED = "not loaded"

GGUF_NATIVE_KINDS = (
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "IQ4_NL",
    "IQ4_XS",
)
"""Block kinds the GGUF kernels compute on as stored (kernels/gguf_blocks_torch.GGUF_KINDS)."""
FLOAT_KINDS = ("F32", "F16", "BF16", "F64")
_LINEAR_WEIGHTS = (
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
)


class UnreadableModelError(LLMServeError):
    """The path is not a model file llmserve can read at all (missing, not GGUF, bad JSON)."""


@dataclass(frozen=True, slots=True)
class TensorFormat:
    """The tensors of one storage type and what the worker makes of them."""

    type: str
    """As the file names it: F32, BF16, Q4_K, Q6_K, ..."""
    num_tensors: int
    num_parameters: int
    file_bytes: int
    at_load: dict[str, int]
    """What the worker does with these tensors at load -> how many tensors (empty when the
    model is refused before the weights could be placed)."""


@dataclass(frozen=True, slots=True)
class ArchitectureSummary:
    context_length: int
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rope_theta: float
    switches: dict[str, Any]
    """The family's switches that differ from a plain Llama (see `architecture_switches`)."""


@dataclass(frozen=True, slots=True)
class TokenizerSummary:
    kind: str
    """tokenizer.json (BPE), GGUF gpt2 (byte-level BPE) pre 'smollm', GGUF llama, ..."""
    supported: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class ModelReport:
    path: str
    format: str
    """gguf or hf."""
    name: str
    general_name: str | None
    """A GGUF file's general.name."""
    source_architecture: str | None
    """The file's own name for the architecture: model_type or general.architecture."""
    family: str | None
    """The registry's family (None: refused)."""
    num_parameters: int
    file_bytes: int
    tensor_formats: tuple[TensorFormat, ...]
    weight_memory_bytes: dict[str, int] | None
    """Estimated resident weights per --dtype (None: not estimated, the model is refused)."""
    architecture: ArchitectureSummary | None
    tokenizer: TokenizerSummary
    chat_template: str | None
    """Where the chat template comes from; None: the model has none (chat is refused)."""
    refusals: tuple[str, ...] = field(default=())
    suggested_chat_template: str | None = None
    """A model without a template: the built-in that fits its family, for --chat-template
    NAME (None: no sign of one, or the model has its own)."""

    @property
    def servable(self) -> bool:
        return not self.refusals

    @property
    def verdict(self) -> str:
        return "servable" if self.servable else "refused: " + "; ".join(self.refusals)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "servable": self.servable, "verdict": self.verdict}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ModelReport:
        # A report written before a field existed leaves it at its default.
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        architecture = fields["architecture"]
        return cls(
            **{
                **fields,
                "tensor_formats": tuple(TensorFormat(**f) for f in fields["tensor_formats"]),
                "architecture": ArchitectureSummary(**architecture) if architecture else None,
                "tokenizer": TokenizerSummary(**fields["tokenizer"]),
                "refusals": tuple(fields["refusals"]),
            }
        )


@dataclass(frozen=True, slots=True)
class _Tensor:
    """One stored tensor: its type, how many values, its bytes in the file, its rows."""

    name: str
    type: str
    num_parameters: int
    file_bytes: int
    num_rows: int


def describe_model(path: Path) -> ModelReport:
    """The report of a .gguf file or a Hugging Face directory (resolved already)."""
    if path.suffix == ".gguf":
        return _describe_gguf(path)
    return _describe_hf(path)


# --- GGUF ------------------------------------------------------------------------------------


def _describe_gguf(path: Path) -> ModelReport:
    try:
        reader = open_gguf(path)
    except ModelLoadError as exc:
        raise UnreadableModelError(str(exc)) from exc
    refusals: list[str] = []
    tensors = [
        _Tensor(
            t.name,
            t.tensor_type.name,
            int(t.n_elements),
            int(t.n_bytes),
            int(t.shape[-1]) if len(t.shape) > 1 else 1,
        )
        for t in reader.tensors
    ]
    family, architecture = _registry(
        lambda: gguf_model_architecture(open_gguf_index(path)), refusals
    )
    at_load: dict[str, str] = {}
    memory = None
    if family is not None and architecture is not None:
        placed = _placed(tensors, lambda name: gguf_part(family, name), refusals)
        if placed is not None:
            at_load = _gguf_at_load(tensors, placed)
            memory = _memory(tensors, at_load, architecture)
    refusals.extend(_undequantizable(tensors))
    tokenizer, model_tokenizer = _tokenizer_summary(path, _gguf_tokenizer_kind(reader), refusals)
    template = field_value(reader, "tokenizer.chat_template")
    general_name = field_value(reader, "general.name")
    source_architecture = _optional_str(field_value(reader, "general.architecture"))
    suggested = None
    if not template:
        suggested = _suggested_template(
            source_architecture,
            f"{general_name or ''} {path.name}",
            architecture,
            model_tokenizer,
        )
    return ModelReport(
        path=str(path),
        format="gguf",
        name=model_display_name(path),
        general_name=str(general_name) if general_name is not None else None,
        source_architecture=source_architecture,
        family=family.name if family else None,
        num_parameters=sum(t.num_parameters for t in tensors),
        file_bytes=path.stat().st_size,
        tensor_formats=_formats(tensors, at_load),
        weight_memory_bytes=memory,
        architecture=_summary(architecture) if architecture else None,
        tokenizer=tokenizer,
        chat_template="GGUF tokenizer.chat_template" if template else None,
        refusals=tuple(refusals),
        suggested_chat_template=suggested,
    )


def _gguf_at_load(tensors: Sequence[_Tensor], placed: dict[str, PartName | None]) -> dict[str, str]:
    """As gguf_direct.load_gguf_quantized decides: a linear layer whose parts are all of native
    kinds (mixed or not) keeps its blocks; a native embedding
    keeps its blocks (a tied head shares them, an untied head keeps its own when native, else
    int8 rows); a non-native embedding and the head both become int8 rows; the rest is
    dequantized to the model dtype by the float loader."""
    kinds: dict[str, dict[int, str]] = {}
    num_parts: dict[str, int] = {}
    for tensor in tensors:
        where = placed[tensor.name]
        if where is not None:
            kinds.setdefault(where.parameter, {})[where.part] = tensor.type
            num_parts[where.parameter] = where.num_parts

    def native_layer(parameter: str) -> str | None:
        found = kinds[parameter]
        if len(found) != num_parts[parameter] or not set(found.values()) <= {*GGUF_NATIVE_KINDS}:
            return None
        return STORED_BLOCKS

    embedding_native = kinds.get("embed_tokens.weight", {}).get(0) in GGUF_NATIVE_KINDS
    at_load: dict[str, str] = {}
    for tensor in tensors:
        where = placed[tensor.name]
        fallback = MODEL_DTYPE if tensor.type in FLOAT_KINDS else DEQUANTIZED
        if where is None:
            at_load[tensor.name] = ROPE_SETTINGS
        elif where.parameter == "embed_tokens.weight":
            at_load[tensor.name] = STORED_BLOCKS if embedding_native else INT8_ROWS
        elif where.parameter == "lm_head.weight":
            native = embedding_native and native_layer(where.parameter) == STORED_BLOCKS
            at_load[tensor.name] = STORED_BLOCKS if native else INT8_ROWS
        elif where.parameter.endswith(_LINEAR_WEIGHTS):
            at_load[tensor.name] = native_layer(where.parameter) or fallback
        else:
            at_load[tensor.name] = fallback
    return at_load


def _undequantizable(tensors: Sequence[_Tensor]) -> list[str]:
    """The loader's refusal for each tensor type gguf-py cannot dequantize (first tensor)."""
    refusals: list[str] = []
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.type not in seen and not _can_dequantize(tensor.type):
            refusals.append(
                f"GGUF tensor {tensor.name!r} has type {tensor.type},"
                " which gguf-py cannot dequantize"
            )
        seen.add(tensor.type)
    return refusals


@functools.cache
def _can_dequantize(kind: str) -> bool:
    """Whether gguf-py dequantizes this type: one zero block through the loader's own call."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import dequantize

    qtype = GGMLQuantizationType[kind]
    _, type_size = GGML_QUANT_SIZES[qtype]
    try:
        dequantize(np.zeros(type_size, dtype=np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _gguf_tokenizer_kind(reader: Any) -> str:
    kind = field_value(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        pre = field_value(reader, "tokenizer.ggml.pre")
        return f"GGUF gpt2 (byte-level BPE), pre-tokenizer {pre!r}"
    if kind == "llama":
        return "GGUF llama (SentencePiece)"
    return f"GGUF {kind!r}" if kind is not None else "none in the GGUF metadata"


# --- Hugging Face directory ------------------------------------------------------------------


def _describe_hf(directory: Path) -> ModelReport:
    try:
        config = json.loads((directory / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UnreadableModelError(f"cannot read {directory / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise UnreadableModelError(f"{directory / 'config.json'} is not a JSON object")
    refusals: list[str] = []
    family, architecture = _registry(lambda: hf_model_architecture(directory), refusals)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        refusals.append(f"no *.safetensors files in {directory}")
    tensors = [t for file in files for t in _safetensors_tensors(file)]
    at_load: dict[str, str] = {}
    memory = None
    if family is not None and architecture is not None and files:
        placed = _placed(tensors, lambda name: hf_part(family, name), refusals)
        if placed is not None:
            at_load = _hf_at_load(placed, architecture.tie_word_embeddings)
            memory = _memory(tensors, at_load, architecture)
    # A tied checkpoint may store the head too; the model holds one table.
    counted = [t for t in tensors if at_load.get(t.name) != SHARED_WITH_EMBEDDING]
    tokenizer, model_tokenizer = _tokenizer_summary(
        directory, _hf_tokenizer_kind(directory), refusals
    )
    chat_template = _hf_chat_template(directory)
    suggested = None
    if chat_template is None:
        suggested = _suggested_template(
            _optional_str(config.get("model_type")),
            f"{config.get('_name_or_path') or ''} {directory.name}",
            architecture,
            model_tokenizer,
        )
    return ModelReport(
        path=str(directory),
        format="hf",
        name=model_display_name(directory),
        general_name=None,
        source_architecture=_optional_str(config.get("model_type")),
        family=family.name if family else None,
        num_parameters=sum(t.num_parameters for t in counted),
        file_bytes=sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
        tensor_formats=_formats(tensors, at_load),
        weight_memory_bytes=memory,
        architecture=_summary(architecture) if architecture else None,
        tokenizer=tokenizer,
        chat_template=chat_template,
        refusals=tuple(refusals),
        suggested_chat_template=suggested,
    )


def _hf_at_load(placed: dict[str, PartName | None], tied: bool) -> dict[str, str]:
    """Every weight in the model dtype (--quantization auto is none for a directory)."""
    at_load = {}
    for name, where in placed.items():
        if where is None:
            at_load[name] = NOT_LOADED
        elif tied and where.parameter == "lm_head.weight":
            at_load[name] = SHARED_WITH_EMBEDDING
        else:
            at_load[name] = MODEL_DTYPE
    return at_load


def _safetensors_tensors(file: Path) -> list[_Tensor]:
    """The tensors a safetensors file holds, from its header alone: an 8-byte little-endian
    length, then that many bytes of JSON {name: {dtype, shape, data_offsets}}."""
    try:
        with file.open("rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise UnreadableModelError(f"cannot read the safetensors header of {file}: {exc}") from exc
    tensors = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        shape = [int(d) for d in entry["shape"]]
        start, end = entry["data_offsets"]
        tensors.append(
            _Tensor(name, entry["dtype"], _product(shape), end - start, shape[0] if shape else 1)
        )
    return tensors


def _hf_tokenizer_kind(directory: Path) -> str:
    tokenizer_file = directory / "tokenizer.json"
    if tokenizer_file.is_file():
        try:
            model = json.loads(tokenizer_file.read_text()).get("model") or {}
        except (OSError, json.JSONDecodeError, AttributeError):
            return "tokenizer.json (unreadable)"
        return f"tokenizer.json ({model.get('type', 'unknown model')})"
    if (directory / "tokenizer.model").is_file():
        return "SentencePiece tokenizer.model only"
    return "none"


def _hf_chat_template(directory: Path) -> str | None:
    """Where ModelTokenizer.from_hf_directory finds the template: tokenizer_config.json's
    chat_template first (a single string; a list of named templates is not read), then
    chat_template.jinja."""
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        try:
            template = json.loads(config_file.read_text()).get("chat_template")
        except (OSError, json.JSONDecodeError, AttributeError):
            template = None
        if isinstance(template, str):
            return "tokenizer_config.json chat_template"
    if (directory / "chat_template.jinja").is_file():
        return "chat_template.jinja"
    return None


# --- shared ----------------------------------------------------------------------------------


def _registry(
    read: Callable[[], tuple[ModelFamily, ModelArchitecture]], refusals: list[str]
) -> tuple[ModelFamily | None, ModelArchitecture | None]:
    try:
        family, architecture = read()
    except ModelLoadError as exc:
        refusals.append(str(exc))
        return None, None
    return family, architecture


def _placed(
    tensors: Sequence[_Tensor], part_of: Callable[[str], PartName | None], refusals: list[str]
) -> dict[str, PartName | None] | None:
    """Each tensor's place in the decoder, as the loader names it; None (and a refusal) when
    some tensor has none, which the loader refuses."""
    placed: dict[str, PartName | None] = {}
    unexpected: list[str] = []
    for tensor in tensors:
        try:
            placed[tensor.name] = part_of(tensor.name)
        except ModelLoadError as exc:
            unexpected.append(str(exc))
    if not unexpected:
        return placed
    more = f" (and {len(unexpected) - 1} more)" if len(unexpected) > 1 else ""
    refusals.append(unexpected[0] + more)
    return None


def _memory(
    tensors: Sequence[_Tensor], at_load: dict[str, str], arch: ModelArchitecture
) -> dict[str, int]:
    """Resident weight bytes per dtype: what each tensor becomes, plus the fp32 rope tables
    (one row per position of the context)."""
    rope_bytes = sum(
        arch.max_position_embeddings * int(arch.head_dim * rope.partial_rotary_factor) * 4
        for rope in _ropes(arch)
    )
    memory = {}
    for dtype, size in DTYPE_BYTES.items():
        total = rope_bytes
        for tensor in tensors:
            total += _tensor_memory(tensor, at_load[tensor.name], size)
        memory[dtype] = total
    return memory


def _tensor_memory(tensor: _Tensor, at_load: str, dtype_bytes: int) -> int:
    values = tensor.num_parameters
    if at_load == STORED_BLOCKS:
        return tensor.file_bytes
    if at_load == INT8_ROWS:
        return values + tensor.num_rows * dtype_bytes
    if at_load in (SHARED_WITH_EMBEDDING, ROPE_SETTINGS, NOT_LOADED):
        return 0
    return values * dtype_bytes


def _ropes(arch: ModelArchitecture) -> list[RopeConfig]:
    return [arch.rope] if arch.local_rope is None else [arch.rope, arch.local_rope]


def _formats(tensors: Iterable[_Tensor], at_load: dict[str, str]) -> tuple[TensorFormat, ...]:
    """Per storage type, most parameters first."""
    by_type: dict[str, list[_Tensor]] = {}
    for tensor in tensors:
        by_type.setdefault(tensor.type, []).append(tensor)
    formats = []
    for kind, members in by_type.items():
        counts: dict[str, int] = {}
        for tensor in members:
            if tensor.name in at_load:
                counts[at_load[tensor.name]] = counts.get(at_load[tensor.name], 0) + 1
        formats.append(
            TensorFormat(
                type=kind,
                num_tensors=len(members),
                num_parameters=sum(t.num_parameters for t in members),
                file_bytes=sum(t.file_bytes for t in members),
                at_load=counts,
            )
        )
    return tuple(sorted(formats, key=lambda f: -f.num_parameters))


def _tokenizer_summary(
    path: Path, kind: str, refusals: list[str]
) -> tuple[TokenizerSummary, ModelTokenizer | None]:
    """Builds the tokenizer as the worker and the tokenizer tier do (None: it cannot)."""
    try:
        tokenizer = ModelTokenizer.from_path(path)
    except ModelLoadError as exc:
        refusals.append(str(exc))
        return TokenizerSummary(kind, supported=False, error=str(exc)), None
    return TokenizerSummary(kind, supported=True), tokenizer


def _suggested_template(
    source_architecture: str | None,
    name: str,
    architecture: ModelArchitecture | None,
    tokenizer: ModelTokenizer | None,
) -> str | None:
    """The built-in chat template that fits a model that ships none."""

    def has_token(token: str) -> bool:
        return tokenizer is not None and tokenizer.tokenizer.token_to_id(token) is not None

    vocab_size = architecture.vocab_size if architecture is not None else None
    return builtin_for_model(source_architecture, name, vocab_size, has_token)


def _summary(arch: ModelArchitecture) -> ArchitectureSummary:
    return ArchitectureSummary(
        context_length=arch.max_position_embeddings,
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        intermediate_size=arch.intermediate_size,
        num_heads=arch.num_heads,
        num_kv_heads=arch.num_kv_heads,
        head_dim=arch.head_dim,
        vocab_size=arch.vocab_size,
        rope_theta=arch.rope.theta,
        switches=architecture_switches(arch),
    )


def _product(shape: Iterable[int]) -> int:
    total = 1
    for dim in shape:
        total *= dim
    return total


def _optional_str(value: Any) -> str | None:
    return None if value is None else str(value)
