"""`bench memory` and the real-size shapes, their pure parts: KV capacity arithmetic (the worker
gets exactly llama-server's KV bytes), /proc status parsing, the table, the parameter counts,
and the Q4_K_M layout the 8B file is written with."""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from benchmarks.memory import llama_server_kv_mib, worker_command
from benchmarks.memory_table import (
    EngineMemory,
    FileMemory,
    GiB,
    kv_cache_gib,
    kv_geometry,
    memory_table,
    tree_notes,
)
from benchmarks.model_shapes import SHAPES, check_types, parse_shape_ref
from benchmarks.process_memory import (
    MemoryStatus,
    TreeMemory,
    descendants,
    parse_parent_pid,
    parse_status,
)
from benchmarks.synthetic_gguf import (
    TensorPlan,
    llama_tensor_plan,
    q4_k_m_type,
    random_blocks,
    use_more_bits,
)

MiB = 1 << 20


def llama_metadata(**overrides: object) -> dict[str, object]:
    """GGUF keys of Llama 3.2 1B."""
    return {
        "general.architecture": "llama",
        "llama.block_count": 16,
        "llama.embedding_length": 2048,
        "llama.attention.head_count": 32,
        "llama.attention.head_count_kv": 8,
        **overrides,
    }


# ---- KV capacity -------------------------------------------------------------------------


def test_kv_bytes_per_token_is_k_and_v_of_every_layer_in_f16() -> None:
    geometry = kv_geometry(llama_metadata())
    assert geometry.bytes_per_token() == 2 * 16 * 8 * 64 * 2 == 32 * 1024
    assert geometry.cache_bytes(8192) == 256 * MiB
    assert kv_cache_gib(256 * MiB) == 0.25


def test_kv_geometry_reads_key_lengths_windows_and_per_layer_heads() -> None:
    gemma = {
        "general.architecture": "gemma3",
        "gemma3.block_count": 26,
        "gemma3.embedding_length": 1152,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.head_count_kv": 1,
        "gemma3.attention.key_length": 256,
        "gemma3.attention.value_length": 256,
        "gemma3.attention.sliding_window": 512,
    }
    geometry = kv_geometry(gemma)
    assert geometry.key_length == 256 and geometry.sliding_window == 512
    assert geometry.bytes_per_token() == SHAPES["gemma-3-1b"].kv_bytes_per_token() == 26 * 1024
    per_layer = kv_geometry(llama_metadata(**{"llama.attention.head_count_kv": [8, 0] * 8}))
    assert per_layer.bytes_per_token() == 8 * 8 * 64 * 2 * 2  # layers without KV count 0
    no_kv_key = kv_geometry({**llama_metadata(), "llama.attention.head_count_kv": None})
    assert no_kv_key.num_kv_heads == (32,) * 16
    with pytest.raises(ValueError, match="3 KV head counts for 16 layers"):
        kv_geometry(llama_metadata(**{"llama.attention.head_count_kv": [8, 8, 8]}))


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_worker_gets_exactly_llama_servers_kv_tokens(name: str) -> None:
    """--kv-cache-gib round-trips to the byte, and the worker's block arithmetic (float16,
    16-token blocks) turns it into CONTEXT tokens: the same capacity on both sides."""
    import torch

    from services.worker.kv_cache import KVCacheSpec

    shape = SHAPES[name]
    context = 8192
    cache_bytes = context * shape.kv_bytes_per_token()
    spec = KVCacheSpec(shape.num_layers, shape.num_kv_heads, shape.head_dim, 16, torch.float16)
    assert spec.bytes_per_token == shape.kv_bytes_per_token()
    budget = int(kv_cache_gib(cache_bytes) * GiB)
    assert budget == cache_bytes
    assert spec.num_blocks_for_budget(budget) * spec.block_size == context


def test_worker_command_carries_the_capacity_and_the_float16_cache() -> None:
    command = worker_command(
        Path("/models/llama.Q4_K_M.gguf"),
        port=5555,
        kv_bytes=256 * MiB,
        context=8192,
        slots=16,
        threads=2,
    )
    flags = dict(itertools.pairwise(command))
    assert "worker" in command
    assert flags["--kv-cache-gib"] == "0.25" and flags["--kv-cache-dtype"] == "float16"
    assert flags["--port"] == "5555" and flags["--max-num-seqs"] == "16"
    assert flags["--max-model-len"] == "8192" and flags["--threads"] == "2"


def test_llama_server_kv_size_is_read_from_its_log() -> None:
    log = (
        "llama_kv_cache:        CPU KV buffer size =   256.00 MiB\n"
        "llama_kv_cache: size =  256.00 MiB (  8192 cells,  16 layers, 16/16 seqs)\n"
    )
    assert llama_server_kv_mib(log) == 256.0
    swa = "llama_kv_cache: CPU KV buffer size = 26.00 MiB\nx CPU KV buffer size = 182.5 MiB\n"
    assert llama_server_kv_mib(swa) == 208.5
    assert math.isnan(llama_server_kv_mib("no such line"))


# ---- /proc -------------------------------------------------------------------------------

STATUS = """Name:\tpython
Umask:\t0022
State:\tS (sleeping)
VmPeak:\t 3000000 kB
VmHWM:\t  812345 kB
VmRSS:\t  700000 kB
RssAnon:\t  500000 kB
RssFile:\t  199000 kB
RssShmem:\t    1000 kB
Threads:\t3
"""


def test_status_memory_lines_are_parsed_in_kib() -> None:
    assert parse_status(STATUS) == MemoryStatus(700000, 812345, 500000, 199000, 1000)
    zombie = "Name:\tpython\nState:\tZ (zombie)\nThreads:\t1\n"
    assert parse_status(zombie) is None
    with pytest.raises(ValueError, match="unexpected unit"):
        parse_status("VmRSS:\t 12 MB\nVmHWM:\t 12 kB\n")


def test_parent_pid_survives_a_command_name_with_parentheses_and_spaces() -> None:
    assert parse_parent_pid("4242 (llama (server) x) S 17 4242 4242 0 -1") == 17


def test_descendants_are_listed_parents_first() -> None:
    parents = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 99: 98}
    assert descendants(parents, 10) == [10, 11, 12, 13]
    assert descendants(parents, 99) == [99]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_tree_memory_counts_a_child_process() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = TreeMemory(os.getpid())
        for _ in range(50):  # until the child has its address space
            tree.sample()
            if child.pid in tree.live:
                break
            time.sleep(0.05)
        assert child.pid in tree.live and os.getpid() in tree.live
        current = tree.current()
        assert current.rss_kib > 0 and tree.peak_kib >= current.rss_kib
    finally:
        child.kill()
        child.wait()
    tree.sample()
    assert child.pid not in tree.live and child.pid in tree.seen  # its peak still counts


# ---- the table ---------------------------------------------------------------------------


def test_table_has_a_row_per_file_with_ratios_and_dashes_for_what_failed() -> None:
    ours = EngineMemory("llmserve", ready_s=4.0, peak_mib=1500.0, steady_rss_mib=1000.0)
    theirs = EngineMemory("llama-server", ready_s=1.0, peak_mib=900.0, steady_rss_mib=800.0)
    good = FileMemory("llama-3.2-1b:Q4_K_M", "/x.gguf", 638.0, 256 * MiB)
    good.engines = {"llmserve": ours, "llama-server": theirs}
    failed = FileMemory("broken.gguf", "/b.gguf", 10.0, MiB)
    failed.engines = {"llmserve": EngineMemory("llmserve", error="exited with 1")}
    table = memory_table([good, failed]).splitlines()
    assert "llmserve peak MiB" in table[0] and "steady ratio" in table[0]
    assert len(table) == 4
    cells = [cell.strip() for cell in table[2].strip("|").split("|")]
    assert cells[:3] == ["llama-3.2-1b:Q4_K_M", "638.0", "256.0"]
    assert cells[9:] == ["1.25", "1.50", "1.12"]  # 1000/800, 1500/1000, 900/800
    failed_cells = [cell.strip() for cell in table[3].strip("|").split("|")]
    assert failed_cells[3:] == ["-"] * 9


def test_a_tree_with_children_gets_a_note_and_a_single_process_none() -> None:
    single = FileMemory("a.gguf", "/a.gguf", 1.0, MiB)
    single.engines = {"llmserve": EngineMemory("llmserve", num_processes=1)}
    compiled = FileMemory("b.gguf", "/b.gguf", 1.0, MiB)
    compiled.engines = {"llmserve": EngineMemory("llmserve", num_processes=28)}
    notes = tree_notes([single, compiled])
    assert len(notes) == 1 and notes[0].startswith("b.gguf llmserve: 28 processes")


# ---- shapes --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "vocab_size", "published"),
    [
        ("llama-3.2-1b", 128256, 1_235_814_400),
        ("llama-3.2-3b", 128256, 3_212_749_824),
        ("qwen2.5-1.5b", 151936, 1_543_714_304),
        ("gemma-3-1b", 262144, 999_885_952),
        ("llama-3.1-8b", 128256, 8_030_261_248),
    ],
)
def test_parameter_counts_match_the_published_models_with_their_own_vocabulary(
    name: str, vocab_size: int, published: int
) -> None:
    assert replace(SHAPES[name], vocab_size=vocab_size).num_params == published


def test_with_the_embedded_vocabulary_llama_1b_has_1_07b_parameters() -> None:
    assert SHAPES["llama-3.2-1b"].num_params == 1_073_809_408


def test_shape_references_and_types_are_checked() -> None:
    shape, quant_type = parse_shape_ref("llama-3.2-1b:q4_0")
    assert shape.name == "llama-3.2-1b" and quant_type == "Q4_0"
    assert parse_shape_ref("llama-3.1-8b") == (SHAPES["llama-3.1-8b"], "Q4_K_M")
    with pytest.raises(ValueError, match="unknown shape"):
        parse_shape_ref("llama-9b")
    with pytest.raises(ValueError, match="Q4_K_M"):
        check_types(SHAPES["llama-3.1-8b"], ["Q4_0"])  # the direct writer makes Q4_K_M only
    assert check_types(SHAPES["gemma-3-1b"], ["Q4_K_M", "q8_0", "Q4_K_M"]) == ["Q4_K_M", "Q8_0"]


# ---- the 8B file's Q4_K_M layout (llama-quant.cpp's rule) ---------------------------------


def test_more_bits_on_half_the_layers_as_llama_quantize_chooses() -> None:
    chosen = [layer for layer in range(32) if use_more_bits(layer, 32)]
    assert chosen == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [layer for layer in range(16) if use_more_bits(layer, 16)] == [
        0, 1, 4, 7, 10, 13, 14, 15,
    ]  # fmt: skip


def test_q4_k_m_types_by_tensor() -> None:
    assert q4_k_m_type("output.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("token_embd.weight", 32, tied_embeddings=False) == "Q4_K"
    assert q4_k_m_type("token_embd.weight", 32, tied_embeddings=True) == "Q6_K"
    assert q4_k_m_type("blk.6.attn_v.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("blk.7.attn_v.weight", 32, tied_embeddings=False) == "Q4_K"
    assert q4_k_m_type("blk.27.ffn_down.weight", 32, tied_embeddings=False) == "Q6_K"
    assert q4_k_m_type("blk.26.ffn_down.weight", 32, tied_embeddings=False) == "Q4_K"
    for other in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up"):
        assert q4_k_m_type(f"blk.0.{other}.weight", 32, tied_embeddings=False) == "Q4_K"
    for vector in ("blk.0.attn_norm.weight", "output_norm.weight", "rope_freqs.weight"):
        assert q4_k_m_type(vector, 32, tied_embeddings=False) == "F32"


def test_the_8b_plan_has_llama_cpps_tensors_and_size() -> None:
    shape = SHAPES["llama-3.1-8b"]
    plans = llama_tensor_plan(shape)
    by_name = {plan.name: plan for plan in plans}
    assert len(plans) == 2 + 9 * 32 + 2
    assert [p.name for p in plans[:2]] == ["token_embd.weight", "rope_freqs.weight"]
    assert plans[-1].name == "output.weight"
    q6 = sorted(p.name for p in plans if p.type_name == "Q6_K")
    assert len(q6) == 16 + 16 + 1
    assert (by_name["blk.0.attn_k.weight"].rows, by_name["blk.0.attn_k.weight"].cols) == (
        1024,
        4096,
    )
    assert by_name["blk.0.ffn_down.weight"].cols == 14336
    assert by_name["rope_freqs.weight"].cols == 64
    # Q4_K: 144 bytes per 256 values, Q6_K: 210; about 4.5 GB in all (4.9 with Llama's vocab).
    assert by_name["output.weight"].nbytes == 49152 * 16 * 210
    total = sum(plan.nbytes for plan in plans)
    assert 4.4e9 < total < 4.5e9


@pytest.mark.parametrize("type_name", ["Q4_K", "Q6_K"])
def test_random_blocks_decode_to_small_finite_weights(type_name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    plan = TensorPlan("blk.0.attn_q.weight", 8, 512, type_name)
    data = random_blocks(plan, np.random.default_rng(0))
    assert data.shape == (8, plan.nbytes // 8)
    weights = quants.dequantize(data, GGMLQuantizationType[type_name])
    assert weights.shape == (8, 512) and np.isfinite(weights).all()
    assert 0.01 < float(weights.std()) < 0.05 and abs(float(weights.mean())) < 0.005
