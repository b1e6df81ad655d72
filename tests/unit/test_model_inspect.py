"""`llmserve inspect` on real files: the embedded GGUF, tiny Hugging Face directories saved by
transformers, GGUF files written with gguf-py (mixed tensor types, an unknown architecture),
and refused or unreadable paths. The memory estimate is held to the tensors a real load keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from services.cli import main
from services.common.model_source import embedded_model_path
from services.inspect_command import measure_load
from services.model_inspect import (
    DEQUANTIZED,
    GGUF_NATIVE_KINDS,
    MODEL_DTYPE,
    STORED_BLOCKS,
    ModelReport,
    describe_model,
)
from services.worker.model.architecture_switches import window_pattern

gguf = pytest.importorskip("gguf")
ROOT = Path(__file__).resolve().parents[2]

HIDDEN = 256  # K-quant blocks hold 256 values: rows must be a multiple
FFN = 512
NUM_LAYERS = 2
CONTEXT = 128


def write_gguf(
    path: Path, architecture: str = "llama", kinds: dict[str, str] | None = None
) -> Path:
    """A tiny Llama-shaped GGUF: byte-level BPE vocabulary of 257 tokens, Q4_0 layers and a
    Q8_0 embedding unless `kinds` (short tensor name -> type) says otherwise. K-quant tensors
    are written as zero blocks (gguf-py cannot quantize to them)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize
    from tokenizers import pre_tokenizers

    kinds = kinds or {}
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_name("tiny test model")
    writer.add_block_count(NUM_LAYERS)
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    tokens = [*sorted(pre_tokenizers.ByteLevel.alphabet()), "Ġt"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_merges(["Ġ t"])
    writer.add_token_types([1] * len(tokens))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")

    def matrix(name: str, rows: int, cols: int, default: str) -> None:
        short = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        kind = GGMLQuantizationType[kinds.get(short, default)]
        if kind.name in ("Q4_0", "Q4_1", "Q8_0", "F16"):
            values = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
            writer.add_tensor(name, quantize(values, kind), raw_dtype=kind)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            writer.add_tensor(
                name, np.zeros((rows, cols // block * size), dtype=np.uint8), raw_dtype=kind
            )

    matrix("token_embd.weight", len(tokens), HIDDEN, "Q8_0")
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(NUM_LAYERS):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, dtype=np.float32))
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.attn_k.weight", HIDDEN // 2, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.attn_v.weight", HIDDEN // 2, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN, "Q4_0")
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN, "Q4_0")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# A file as llama.cpp's K-quant mixes lay them out: a Q6_K embedding, Q4_K and F16 layers,
# one Q4_1 part beside Q4_0 ones, Q8_0 outputs.
MIXED_KINDS = {
    "token_embd": "Q6_K",
    "attn_v": "Q4_1",
    "attn_output": "Q8_0",
    "ffn_up": "F16",
    "ffn_down": "Q4_K",
}


def run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["inspect", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def at_load(report: ModelReport) -> dict[str, dict[str, int]]:
    return {f.type: f.at_load for f in report.tensor_formats}


# --- the embedded model ----------------------------------------------------------------------


def test_the_embedded_model_is_a_servable_llama() -> None:
    report = describe_model(embedded_model_path())
    assert report.servable and report.verdict == "servable"
    assert (report.format, report.family, report.source_architecture) == ("gguf", "llama", "llama")
    assert report.general_name
    assert report.file_bytes == embedded_model_path().stat().st_size
    assert 130e6 < report.num_parameters < 140e6  # SmolLM2-135M
    # Q4_1 layers and a Q8_0 embedding stay as stored; the norms take the model dtype.
    assert at_load(report) == {
        "Q4_1": {STORED_BLOCKS: 210},
        "Q8_0": {STORED_BLOCKS: 1},
        "F32": {MODEL_DTYPE: 61},
    }
    # About the file's size (its blocks), whatever the dtype: only the norms differ.
    assert report.weight_memory_bytes is not None
    assert report.weight_memory_bytes["float32"] > report.weight_memory_bytes["bfloat16"]
    assert report.weight_memory_bytes["float32"] < 1.05 * report.file_bytes
    arch = report.architecture
    assert arch is not None
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (30, 9, 3, 64)
    assert (arch.context_length, arch.vocab_size) == (8192, 49152)
    assert arch.switches == {"tied_embeddings": True}
    assert report.tokenizer.supported and "gpt2" in report.tokenizer.kind
    assert report.chat_template == "GGUF tokenizer.chat_template"


def test_the_command_describes_the_embedded_model_by_default(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli([], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].startswith("SmolLM2-135M-Instruct")
    assert lines[-1] == "servable"
    assert "llama (general.architecture 'llama')" in out
    assert "Q4_1" in out and "stored blocks" in out


def test_a_gguf_without_a_template_is_told_the_builtin_that_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tests.e2e.test_chat_template_stack import gguf_without

    bare = gguf_without(
        embedded_model_path(), tmp_path / "SmolLM2-bare.gguf", "tokenizer.chat_template"
    )
    report = describe_model(bare)
    assert report.chat_template is None
    # SmolLM2's vocabulary holds ChatML's markers (its architecture, "llama", would not say).
    assert report.suggested_chat_template == "chatml"
    assert describe_model(embedded_model_path()).suggested_chat_template is None
    code, out, _ = run_cli([str(bare)], capsys)
    assert code == 0
    [line] = [line for line in out.splitlines() if "chat template" in line]
    assert "chat requests are refused" in line and "--chat-template chatml" in line
    assert "ChatML default" not in out


@pytest.mark.slow
def test_load_reports_resident_memory_and_the_tensors_match_the_estimate(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, _ = run_cli(["--load", "--json"], capsys)
    assert code == 0
    document = json.loads(out)
    load = document["load"]
    assert load["after"]["rss_bytes"] > 0 and load["before"]["rss_bytes"] > 0
    assert load["after"]["peak_rss_bytes"] >= load["after"]["rss_bytes"]
    assert (load["dtype"], load["quantization"]) == ("float32", "gguf")
    assert load["model_tensor_bytes"] == document["weight_memory_bytes"]["float32"]
    # The worker's budget: the file's blocks by kind, the default 1 GiB KV cache in whole
    # blocks, and a runtime share that is what the process holds beyond both.
    budget = load["memory_budget"]
    assert set(budget["weight_bytes_by_kind"]) == {"Q4_1", "Q8_0", "float32"}
    assert sum(budget["weight_bytes_by_kind"].values()) <= load["model_tensor_bytes"]
    assert (
        0
        < (1 << 30) - budget["kv_cache_bytes"]
        < budget["kv_cache_bytes"] / budget["kv_cache_blocks"]
    )
    assert budget["kv_cache_tokens"] == 16 * budget["kv_cache_blocks"]
    assert 0 < budget["runtime_bytes"] < load["after"]["peak_rss_bytes"]
    assert budget["machine_bytes"] > budget["kv_cache_bytes"]


# --- GGUF files written here -----------------------------------------------------------------


def test_a_k_quant_mix_keeps_its_blocks_and_the_estimate_is_what_a_load_holds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_gguf(tmp_path / "mixed.gguf", kinds=MIXED_KINDS)
    report = describe_model(path)
    assert report.servable, report.verdict
    assert at_load(report) == {
        # q, k (Q4_0) with v (Q4_1): one layer of two parts; gate (Q4_0) beside up (F16):
        # float.
        "Q4_0": {STORED_BLOCKS: 4, DEQUANTIZED: 2},
        "Q4_1": {STORED_BLOCKS: 2},
        "Q8_0": {STORED_BLOCKS: 2},
        "Q4_K": {STORED_BLOCKS: 2},
        "F16": {MODEL_DTYPE: 2},
        # A K-quant embedding: the tied head reads the table's own blocks.
        "Q6_K": {STORED_BLOCKS: 1},
        "F32": {MODEL_DTYPE: 5},
    }
    assert report.weight_memory_bytes is not None
    for dtype in ("float32", "bfloat16"):
        load = measure_load(path, dtype)
        assert load["model_tensor_bytes"] == report.weight_memory_bytes[dtype], dtype
        assert load["after"]["rss_bytes"] > 0
    code, out, _ = run_cli([str(path)], capsys)
    assert code == 0 and "Q6_K" in out and "stored blocks" in out


def test_an_unknown_gguf_architecture_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_gguf(tmp_path / "mamba.gguf", architecture="mamba")
    report = describe_model(path)
    assert report.family is None and report.source_architecture == "mamba"
    assert report.refusals == (
        "GGUF architecture 'mamba' is not supported (supported: llama, mistral, qwen2, qwen3,"
        " gemma, gemma2, gemma3, phi3, granite, smollm3, olmo2)",
    )
    assert report.weight_memory_bytes is None
    code, out, _ = run_cli([str(path), "--load"], capsys)
    assert code == 2
    assert out.splitlines()[-1].startswith("refused: GGUF architecture 'mamba'")
    assert "skipped" in out


def test_a_tensor_type_gguf_py_cannot_dequantize_is_refused(tmp_path: Path) -> None:
    # Q8_K is llama.cpp's intermediate type for activations; no file should store it.
    path = write_gguf(tmp_path / "q8k.gguf", kinds={"ffn_down": "Q8_K"})
    report = describe_model(path)
    assert not report.servable
    assert "'blk.0.ffn_down.weight' has type Q8_K" in report.verdict
    # The worker's loader refuses the same file at start, naming the same tensor.
    from services.contracts.errors import ModelLoadError
    from services.worker.loader.model_loader import load_model

    with pytest.raises(ModelLoadError, match=r"'blk\.0\.ffn_down\.weight' has type Q8_K"):
        load_model(path, quantization="gguf")


def test_inspect_never_imports_torch(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "plain.gguf")
    code = f"""
import sys
from services.cli import main
assert main(["inspect", {str(path)!r}]) == 0
print(sorted(name for name in sys.modules if name == "torch" or name.startswith("torch.")))
"""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


# --- Hugging Face directories ----------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from tests.model.random_hf_models import build_random_hf_model

    root = tmp_path_factory.mktemp("hf")
    names = ("gemma2", "gemma3", "phi4-mini", "llama3")
    return {name: build_random_hf_model(name, root / name) for name in names}


def test_gemma2_reports_its_windows_soft_caps_and_norms(hf_models: dict[str, Path]) -> None:
    report = describe_model(hf_models["gemma2"])
    assert report.servable and (report.family, report.source_architecture) == ("gemma2",) * 2
    assert report.architecture is not None
    switches = report.architecture.switches
    assert switches["sliding_window"] == {
        "sizes": [32],
        "windowed_layers": 2,
        "num_layers": 4,
        "period": 2,
        "full_attention_layers": [1, 3],
    }
    assert (switches["attn_logit_softcap"], switches["final_logit_softcap"]) == (5.0, 3.0)
    assert switches["post_norms"] and switches["tied_embeddings"]
    assert switches["hidden_act"] == "gelu_tanh"
    assert "qk_norm" not in switches
    assert report.tokenizer.supported and report.tokenizer.kind == "tokenizer.json (BPE)"
    assert report.chat_template is None
    # Its tokenizer is SmolLM2's (tests/model/random_hf_models.py): the markers say ChatML.
    assert report.suggested_chat_template == "chatml"


def test_gemma3_reports_qk_norm_and_its_local_rope(hf_models: dict[str, Path]) -> None:
    report = describe_model(hf_models["gemma3"])
    assert report.family == "gemma3" and report.source_architecture == "gemma3_text"
    assert report.architecture is not None
    switches = report.architecture.switches
    assert switches["qk_norm"] == "per_head"
    assert switches["sliding_window"]["full_attention_layers"] == [5]
    assert switches["rope_scaling"]["type"] == "linear"
    assert switches["local_rope"] == {"theta": 10000.0}
    assert "attn_logit_softcap" not in switches


def test_partial_rotary_and_rope_scaling_are_reported(hf_models: dict[str, Path]) -> None:
    phi = describe_model(hf_models["phi4-mini"]).architecture
    assert phi is not None and phi.switches["partial_rotary_factor"] == 0.75
    llama = describe_model(hf_models["llama3"]).architecture
    assert llama is not None
    assert llama.switches == {
        "rope_scaling": {"type": "llama3", "factor": 8.0, "original_context_length": 64}
    }


def test_a_directory_estimate_is_its_parameters_in_the_dtype(hf_models: dict[str, Path]) -> None:
    report = describe_model(hf_models["llama3"])
    assert report.architecture is not None and report.weight_memory_bytes is not None
    arch = report.architecture
    rope_bytes = arch.context_length * arch.head_dim * 4
    assert at_load(report) == {"F32": {MODEL_DTYPE: report.tensor_formats[0].num_tensors}}
    assert report.weight_memory_bytes == {
        "float32": report.num_parameters * 4 + rope_bytes,
        "bfloat16": report.num_parameters * 2 + rope_bytes,
    }
    load = measure_load(hf_models["llama3"], "bfloat16")
    assert load["model_tensor_bytes"] == report.weight_memory_bytes["bfloat16"]


def test_json_round_trips(hf_models: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    for path in (hf_models["gemma3"], embedded_model_path()):
        code, out, _ = run_cli([str(path), "--json"], capsys)
        assert code == 0
        document = json.loads(out)
        assert document["servable"] and document["verdict"] == "servable"
        assert ModelReport.from_json(document) == describe_model(path)


def test_a_chat_template_file_is_found(hf_models: dict[str, Path], tmp_path: Path) -> None:
    import shutil

    directory = Path(shutil.copytree(hf_models["llama3"], tmp_path / "chat"))
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    assert describe_model(directory).chat_template == "chat_template.jinja"
    (directory / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 }}"}))
    assert describe_model(directory).chat_template == "tokenizer_config.json chat_template"


# --- refused and unreadable ------------------------------------------------------------------


def test_a_falcon_directory_is_refused_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon", "hidden_size": 64}))
    code, out, _ = run_cli([str(tmp_path)], capsys)
    assert code == 2
    verdict = out.splitlines()[-1]
    assert verdict.startswith("refused: model_type 'falcon' is not supported (supported: llama,")
    assert "no tokenizer.json" in verdict
    code, out, _ = run_cli([str(tmp_path), "--json"], capsys)
    document = json.loads(out)
    assert code == 2 and not document["servable"] and document["family"] is None
    assert document["refusals"][0].startswith("model_type 'falcon' is not supported")


def test_a_missing_path_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run_cli([str(tmp_path / "absent.gguf")], capsys)
    assert code == 1 and out == ""
    assert "no such file or directory" in err


def test_an_unreadable_file_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all")
    code, _, err = run_cli([str(garbage)], capsys)
    assert code == 1 and "cannot read GGUF file" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    code, _, err = run_cli([str(broken)], capsys)
    assert code == 1 and "cannot read" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    code, _, err = run_cli([str(empty)], capsys)
    assert code == 1 and "neither a .gguf file nor a Hugging Face directory" in err


# --- pieces ----------------------------------------------------------------------------------


def test_window_patterns() -> None:
    gemma3 = window_pattern([512] * 5 + [0] + [512] * 5 + [0] + [512] * 2)
    assert gemma3["period"] == 6 and gemma3["windowed_layers"] == 12
    assert gemma3["full_attention_layers"] == [5, 11]
    mistral = window_pattern([4096] * 4)
    assert mistral["period"] == 1 and mistral["full_attention_layers"] == []
    qwen = window_pattern([0, 0, 32, 32, 32])
    assert qwen["period"] is None and qwen["sizes"] == [32]


def test_native_kinds_are_the_kernels() -> None:
    from kernels.gguf_blocks_torch import GGUF_KINDS

    assert tuple(GGUF_KINDS) == GGUF_NATIVE_KINDS
