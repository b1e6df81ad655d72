"""Every family's tiny model converted to GGUF by llama.cpp's own converter (and re-quantized by
llama-quantize), served by llmserve, against transformers in float32.

- F32 files: every weight we load from the GGUF equals, bit for bit, what we load from the
  Hugging Face directory it was converted from (names, llama.cpp's q/k row permutation,
  Gemma's stored 1 + w, rope settings), and the architectures read from both agree.
- Q8_0, Q4_K_M, Q6_K files: greedy ids equal transformers' on the same weights, dequantized
  by gguf-py (the weights are put into transformers' model through the names the F32 test
  proved), with prompts longer than any sliding window.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.engine.config import EngineConfig
from services.engine.engine import LLMEngine
from services.worker.loaded_model import LoadedModel
from services.worker.loader.model_loader import load_model
from services.worker.loader.weight_names import hf_part, is_norm
from services.worker.model.architecture import ModelArchitecture
from services.worker.model.causal_lm import CausalLM
from services.worker.model.families import hf_model_architecture, model_architecture
from tests.model.gguf_convert import tiny_gguf
from tests.model.test_hf_parity import our_last_logits
from tests.model.tiny_models import FAMILIES, tiny_model_dir

pytestmark = pytest.mark.slow

NUM_NEW_TOKENS = 32
PROMPT_LENS = (100, 67)
QUANTIZED_KINDS = ("q8_0", "Q4_K_M", "Q6_K")
# Q4_K_M (the format most published files use) for every family; the other formats on the
# families whose switches differ most, unless LLMSERVE_FULL_GGUF_MATRIX=1 asks for all
# (about a minute a case on two cores).
WIDE_FAMILIES = ("llama", "gemma3")


def quantized_cases() -> list[tuple[str, str]]:
    full = os.environ.get("LLMSERVE_FULL_GGUF_MATRIX") == "1"
    return [
        (family, kind)
        for family in sorted(FAMILIES)
        for kind in QUANTIZED_KINDS
        if full or kind == "Q4_K_M" or family in WIDE_FAMILIES
    ]


ENGINE = EngineConfig(
    dtype="float32", kv_cache_gib=32 / 1024, seed=0, enforce_eager=True, block_size=16
)


def gguf_or_skip(family: str, kind: str) -> Path:
    from benchmarks.llamacpp_build import PeerBuildError

    try:
        return tiny_gguf(family, kind)
    except PeerBuildError as exc:  # llama-quantize could not be built here
        pytest.skip(f"no {kind} file for {family}: {exc}")


# Rope inputs GGUF stores as float32 (theta, factors, divisors) move angles of up to 4096
# radians by up to 4096 * 6e-8.
ROPE_ATOL = 5e-4
# Float settings GGUF stores as float32.
FLOAT_FIELDS = (
    "rms_norm_eps",
    "embedding_multiplier",
    "residual_multiplier",
    "logits_divisor",
    "attn_logit_softcap",
    "final_logit_softcap",
)


def gguf_drops_the_window(family: str) -> bool:
    """llama.cpp's converter writes Mistral as a plain llama model with no window (and
    llama.cpp serves it so); a GGUF file cannot tell us the window."""
    return family == "mistral"


def assert_same_architecture(hf: ModelArchitecture, gguf: ModelArchitecture) -> None:
    for name in FLOAT_FIELDS:
        assert getattr(gguf, name) == pytest.approx(getattr(hf, name), rel=1e-6), name
    assert gguf.query_scale == pytest.approx(hf.query_scale, rel=1e-6)
    if gguf_drops_the_window(hf.family):
        assert gguf.layer_sliding_windows == () and hf.layer_sliding_windows != ()
        gguf = replace(gguf, layer_sliding_windows=hf.layer_sliding_windows)
    # Compared above, or as tables (GGUF keeps the rope as llama.cpp computes it), or not
    # architecture at all (context length, special ids).
    same = {name: getattr(hf, name) for name in FLOAT_FIELDS}
    same |= {
        "family": hf.family,
        "attention_scale": hf.attention_scale,
        "rope": hf.rope,
        "local_rope": hf.local_rope,
        "max_position_embeddings": 0,
        "bos_token_id": None,
        "eos_token_ids": (),
    }
    assert replace(gguf, **same) == replace(hf, **same)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_f32_gguf_loads_the_checkpoint_exactly(family: str) -> None:
    hf_dir = tiny_model_dir(family)
    gguf = gguf_or_skip(family, "f32")
    from_hf = load_model(hf_dir)
    from_gguf = load_model(gguf)
    _, hf_arch = hf_model_architecture(hf_dir)
    _, gguf_arch = model_architecture(gguf)
    assert_same_architecture(hf_arch, gguf_arch)
    torch.testing.assert_close(from_gguf.rope, from_hf.rope, rtol=0, atol=ROPE_ATOL)
    if from_hf.local_rope is not None:
        torch.testing.assert_close(from_gguf.local_rope, from_hf.local_rope, rtol=0, atol=ROPE_ATOL)
    ours_hf = dict(from_hf.named_parameters())
    for name, value in from_gguf.named_parameters():
        assert torch.equal(value, ours_hf[name]), name
    assert ours_hf.keys() == dict(from_gguf.named_parameters()).keys()


def hf_state_dict(family_name: str, dense: CausalLM, reference) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """transformers' parameters filled from our dense model (dequantized by gguf-py)."""
    from services.worker.model.families import family_by_name

    family = family_by_name(dense.architecture.family)
    arch = dense.architecture
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    state = {}
    for name, tensor in reference.state_dict().items():
        where = hf_part(family, name)
        if where is None:
            continue
        if name == "lm_head.weight" and arch.tie_word_embeddings:
            continue
        value = dense.get_parameter(where.parameter).detach()
        if where.num_parts > 1:
            even = [value.shape[0] // where.num_parts] * where.num_parts
            sizes = [q, kv, kv] if "qkv_proj" in where.parameter else even
            value = value.split(sizes)[where.part]
        if family.hf_norm_offset and is_norm(where.parameter):
            value = value - family.hf_norm_offset
        assert value.shape == tensor.shape, name
        state[name] = value.clone()
    return state


def prompts(vocab_size: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(3, vocab_size, (n,), generator=g).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize(("family", "kind"), quantized_cases())
def test_quantized_gguf_greedy_ids_match_transformers(family: str, kind: str) -> None:
    import transformers

    gguf = gguf_or_skip(family, kind)
    dense = load_model(gguf)  # gguf-py's dequantization, our names
    overrides = {"sliding_window": None} if gguf_drops_the_window(family) else {}
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir(family)), dtype=torch.float32, attn_implementation="eager", **overrides
    )
    reference.load_state_dict(hf_state_dict(family, dense, reference), strict=False)
    reference.eval()
    reference.generation_config.eos_token_id = None

    loaded = LoadedModel.load(str(gguf), torch.float32, quantization="gguf-exact")
    engine = LLMEngine(ENGINE, loaded=loaded)
    batch = prompts(dense.architecture.vocab_size)
    # Random tiny models often repeat one token; the logits say more than the ids.
    ours = our_last_logits(engine, batch[0])
    with torch.inference_mode():
        theirs = reference(torch.tensor([batch[0]])).logits[0, -1].float()
    scale = max(1.0, theirs.abs().max().item())
    assert (ours - theirs).abs().max().item() < 1e-4 * scale
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    for ids, result in zip(batch, engine.generate(batch, greedy), strict=True):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
            )
        assert result.token_ids == out[0, len(ids) :].tolist()
    # The decode steps ran on the fused C++ step, whatever the family's switches.
    fused = engine.runner.fused_decode
    assert fused is not None and fused.num_steps > 0
