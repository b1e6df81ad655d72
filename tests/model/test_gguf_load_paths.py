"""How a GGUF file's weights reach memory (services/worker/loader/, quantization/
gguf_direct.py): blocks the kernels read as stored are views of the file's mapping, repacked
and row-fixed blocks hold the same weights as the file, the embedding and the tied head read
the file's table, and a load never builds a float copy of the model (measured in a subprocess
on a file of real size)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks.model_shapes import SHAPES
from benchmarks.synthetic_gguf import write_q4_k_m
from kernels.gguf_blocks_torch import GGUF_REPACKED_X8
from services.common.gguf_index import GGUFIndex
from services.common.model_source import embedded_model_path
from services.worker.loader.model_loader import load_model
from services.worker.memory_budget import file_mappings, weight_bytes
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear

pytestmark = pytest.mark.slow

LAYERS = (0, 15, 29)


@pytest.fixture(scope="module")
def dense() -> CausalLM:
    """The float model: every tensor dequantized by gguf-py (the reference)."""
    return load_model(embedded_model_path(), quantization="none")


def projections(model: CausalLM, index: int) -> list[tuple[str, torch.nn.Module]]:
    layer = model.layers[index]
    return [
        ("qkv", layer.self_attn.qkv_proj),
        ("o", layer.self_attn.o_proj),
        ("gate_up", layer.mlp.gate_up_proj),
        ("down", layer.mlp.down_proj),
    ]


def transposed_weight(linear: torch.nn.Module, in_features: int) -> torch.Tensor:
    """W^T read through the layer's own kernel: one-hot rows are exact in fp32 and in int8
    activation blocks alike (1.0 rounds to 127 / 127), and each output sums one product."""
    return linear(torch.eye(in_features))


def inside(tensor: torch.Tensor, ranges: list[tuple[int, int]]) -> bool:
    address = tensor.untyped_storage().data_ptr()
    return any(start <= address < end for start, end in ranges)


@pytest.mark.parametrize("quantization", ["gguf", "gguf-exact"])
def test_every_layer_holds_the_files_weights(dense: CausalLM, quantization: str) -> None:
    """Through each projection's kernel, the file's blocks give the dequantized weights
    (exactly with fp32 activations): repacked by 8 rows (gguf's int8 kernels), row-fixed
    (q, k) or as stored."""
    model = load_model(embedded_model_path(), quantization=quantization)
    for index in LAYERS:
        for (name, ours), (_, reference) in zip(
            projections(model, index), projections(dense, index), strict=True
        ):
            assert isinstance(ours, GGUFLinear), name
            expected = reference.weight.t()
            got = transposed_weight(ours, ours.in_features)
            if quantization == "gguf-exact":
                assert torch.equal(got, expected), name
            else:
                # int8 activations: a one-hot row rounds to 127 * (1 / 127), 1 + O(1e-7), and
                # Q4_1's d * q and m are scaled apart: the last bits of a weight may differ
                # (a wrong layout or row order would be off by the weights' own size).
                assert torch.allclose(got, expected, rtol=0, atol=1e-6), name
    repacked = any(kind & GGUF_REPACKED_X8 for kind in model.layers[0].mlp.down_proj.kinds)
    assert repacked == (quantization == "gguf")


@pytest.mark.parametrize("quantization", ["gguf", "gguf-exact"])
def test_the_embedding_and_tied_head_read_the_files_table(
    dense: CausalLM, quantization: str
) -> None:
    model = load_model(embedded_model_path(), quantization=quantization)
    table, head = model.embed_tokens, model.lm_head
    assert isinstance(table, GGUFEmbedding) and isinstance(head, GGUFLinear)
    assert head.blocks_0 is table.blocks  # one copy of the table
    token_ids = torch.tensor([0, 1, 17, 4242, 49151])
    assert torch.equal(table(token_ids), dense.embed_tokens.weight[token_ids])
    hidden = torch.zeros(3, model.architecture.hidden_size)
    hidden[0, 0], hidden[1, 5], hidden[2, 575] = 1.0, 1.0, 1.0
    logits = head(hidden)
    reference = dense.embed_tokens.weight
    assert torch.equal(logits, reference[:, [0, 5, 575]].t())


def test_blocks_read_as_stored_are_the_files_mapping() -> None:
    """Without repacking (gguf-exact), parts that need no row fix (v, o, gate, up, down) are
    views of the file's mapping; q|k (rows llama.cpp permuted) are the worker's own buffer."""
    path = embedded_model_path()
    model = load_model(path, quantization="gguf-exact")
    ranges = file_mappings(path)
    assert ranges, "the file is not mapped"
    layer = model.layers[3]
    qkv = layer.self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear)
    assert not inside(qkv.parts[0], ranges)  # q|k|v of one kind: one buffer (q, k permuted)
    for linear in (layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert isinstance(linear, GGUFLinear)
        assert all(inside(part, ranges) for part in linear.parts)
    by_kind, mapped = weight_bytes(model, path)
    assert set(by_kind) == {"Q4_1", "Q8_0", "float32"}
    assert 0 < mapped < sum(by_kind.values())
    index = GGUFIndex(path)
    gate = index.by_name["blk.3.ffn_gate.weight"]
    assert np.array_equal(
        layer.mlp.gate_up_proj.parts[0].numpy(), index.read(gate)
    )  # the bytes themselves


LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch

    from services.worker.loader.model_loader import load_model
    from services.worker.memory_budget import resident_bytes


    def peak():
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024


    from kernels import cpu_extension

    cpu_extension.load()
    before = resident_bytes()
    model = load_model(Path(sys.argv[1]), quantization="gguf")
    loaded_peak = peak()
    with torch.no_grad():  # every weight read once, as the first steps do
        for layer in model.layers:
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                           layer.mlp.gate_up_proj, layer.mlp.down_proj):
                linear(torch.ones(1, linear.in_features))
        model.lm_head(torch.ones(1, model.lm_head.in_features))
    print(json.dumps({"before": before, "loaded_peak": loaded_peak, "peak": peak(),
                      "after_reads": resident_bytes()}))
    """
)


def test_a_load_never_holds_a_float_copy(tmp_path: Path) -> None:
    """A ~530 MB Q4_K_M file (2 layers of Llama 3.1 8B's shape, written by the benchmarks'
    builder): the load's peak is within 1.3x the file over the process's start, and after
    every weight has been read the process holds about the file once. A float copy would be
    ~3.6 GB (4 bytes per weight)."""
    shape = dataclasses.replace(SHAPES["llama-3.1-8b"], name="llama-8b-2-layers", num_layers=2)
    path = tmp_path / "llama-8b-2-layers.Q4_K_M.gguf"
    write_q4_k_m(shape, path)
    size = path.stat().st_size
    assert 400 << 20 < size < 700 << 20
    run = subprocess.run(
        [sys.executable, "-c", LOAD_SCRIPT, str(path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
        cwd=Path(__file__).parents[2],
    )
    assert run.returncode == 0, run.stderr[-3000:]
    memory = json.loads(run.stdout.strip().splitlines()[-1])
    assert memory["loaded_peak"] - memory["before"] < 1.3 * size, memory
    assert memory["peak"] - memory["before"] < 1.3 * size, memory
    # Everything but the embedding read once (a lookup reads only its rows): those bytes are
    # resident, mapped or (q, k: rows llama.cpp permuted) copied.
    embedding = GGUFIndex(path).by_name["token_embd.weight"].num_bytes
    assert memory["after_reads"] - memory["before"] > 0.9 * (size - embedding), memory


def test_max_model_len_sizes_the_rope_tables_and_never_exceeds_the_context() -> None:
    """--max-model-len reaches the loader: the rope tables hold that many positions (a Llama
    3.1 8B's 131072 would be 64 MB of them), and a larger value is capped at the context."""
    path = embedded_model_path()
    short = load_model(path, quantization="gguf", max_positions=512)
    assert short.rope.shape[0] == 512
    context = short.architecture.max_position_embeddings
    long = load_model(path, quantization="gguf", max_positions=10 * context)
    assert long.rope.shape[0] == context


def test_a_part_is_read_into_a_given_buffer_as_into_its_own() -> None:
    """`part_bytes(…, out=)` (the loader's arena slices) gives the bytes a fresh read gives,
    row fix included; a buffer of the wrong size is refused naming the tensor."""
    from services.worker.loader.gguf_loader import PlacedPart, part_bytes

    index = GGUFIndex(embedded_model_path())
    query = index.by_name["blk.0.attn_q.weight"]
    for heads in (0, 9):  # as stored, and with llama.cpp's rotary rows undone
        placed = PlacedPart(query, 0, heads)
        into = np.full(query.num_bytes, 0xAB, np.uint8)
        got = part_bytes(index, placed, into)
        assert np.shares_memory(got, into)
        assert np.array_equal(got, part_bytes(index, placed))
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight"):
        index.read(query, np.empty(query.num_bytes - 1, np.uint8))
