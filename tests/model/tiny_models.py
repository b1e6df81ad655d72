"""Tiny random models of each family the worker serves, built offline as Hugging Face
directories with transformers' own config and model classes (fixed seed, float32 safetensors),
each with a tokenizer in the family's style and, where the family has one, a chat template.

    build_tiny_model("qwen3", directory)  # -> directory, built now
    tiny_model_dir("qwen3")               # -> the cached directory, built once per version

Shapes are shared so that llama-quantize's K-quants really apply: every weight row that K-quants
split into 256-value super-blocks (the input dimension: hidden 256, intermediate 512, query
heads x head_dim 512) is a multiple of 256. Families that allow it set head_dim (128) apart from
hidden / heads (64). Every 1-D weight (norms, biases) gets noise on top of its init, so that a
loader that drops a bias or the Gemma "1 + w" shift changes the logits.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from services.common import cache_files
from tests.model.tiny_tokenizers import BpeRecipe, SpmRecipe, TokenizerRecipe

# Bump when a change here changes the built files: cached directories are keyed by it.
TINY_MODELS_VERSION = 1
SEED = 0

HIDDEN_SIZE = 256
INTERMEDIATE_SIZE = 512
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
HEAD_DIM = 128  # != HIDDEN_SIZE // NUM_HEADS, where the family allows it
MAX_POSITIONS = 4096

LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}"
    "<|end_header_id|>\n\n{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "[INST] {{ message['content'] }} [/INST]{% else %}{{ message['content'] }}{{ eos_token }}"
    "{% endif %}{% endfor %}"
)
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
PHI3_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)
OLMO2_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n"
    "{{ message['content'] }}\n{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
GRANITE_TEMPLATE = (
    "{% for message in messages %}<|start_of_role|>{{ message['role'] }}<|end_of_role|>"
    "{{ message['content'] }}<|end_of_text|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|start_of_role|>assistant<|end_of_role|>{% endif %}"
)

LLAMA3_TOKENIZER = BpeRecipe(
    vocab="llama-bpe",
    pre_tokenizer="llama3",
    tokenizer_class="PreTrainedTokenizerFast",
    bos_token="<|begin_of_text|>",
    eos_token="<|eot_id|>",
    add_bos_token=True,
    ignore_merges=True,
    expected_pre="llama-bpe",
)
QWEN2_TOKENIZER = BpeRecipe(
    vocab="qwen2",
    pre_tokenizer="qwen2",
    tokenizer_class="Qwen2Tokenizer",
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="<|endoftext|>",
    add_bos_token=False,
    nfc=True,
    expected_pre="qwen2",
)
SPM_LLAMA_TOKENIZER = SpmRecipe(layout="llama", tokenizer_class="LlamaTokenizer")
SPM_GEMMA_TOKENIZER = SpmRecipe(layout="gemma", tokenizer_class="GemmaTokenizer")
SPM_PHI3_TOKENIZER = SpmRecipe(
    layout="llama",
    tokenizer_class="LlamaTokenizer",
    added_special_tokens=("<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"),
    eos_token="<|endoftext|>",
)


def longrope_factors(rotary_dim: int) -> dict[str, list[float]]:
    """Phi-3's per-frequency factors: near 1 for short contexts, rising for long ones."""
    count = rotary_dim // 2
    return {
        "short_factor": [1.0 + 0.05 * index / count for index in range(count)],
        "long_factor": [1.0 + 7.0 * (index / count) ** 2 for index in range(count)],
    }


@dataclass(frozen=True, slots=True)
class FamilySpec:
    """One tiny model: transformers classes, the family's switches, its tokenizer."""

    config_class: str
    model_class: str
    config: dict[str, Any]
    tokenizer: TokenizerRecipe
    chat_template: str | None
    # The config's vocab_size for BPE families (the real family's, padding included); SPM
    # families take their trained vocabulary's size.
    vocab_size: int | None = None


def common(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "hidden_size": HIDDEN_SIZE,
        "intermediate_size": INTERMEDIATE_SIZE,
        "num_hidden_layers": NUM_LAYERS,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
    }
    config.update(overrides)
    return config


FAMILIES: dict[str, FamilySpec] = {
    "llama": FamilySpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        common(
            head_dim=HEAD_DIM,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 512,
            },
        ),
        LLAMA3_TOKENIZER,
        LLAMA3_TEMPLATE,
        vocab_size=128256,
    ),
    "llama-yarn": FamilySpec(
        "LlamaConfig",
        "LlamaForCausalLM",
        common(
            head_dim=HEAD_DIM,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 1024,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
        LLAMA3_TOKENIZER,
        LLAMA3_TEMPLATE,
        vocab_size=128256,
    ),
    "mistral": FamilySpec(
        "MistralConfig",
        "MistralForCausalLM",
        common(
            head_dim=HEAD_DIM,
            sliding_window=32,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        SPM_LLAMA_TOKENIZER,
        MISTRAL_TEMPLATE,
    ),
    "qwen2": FamilySpec(
        "Qwen2Config",
        "Qwen2ForCausalLM",  # q/k/v biases are built in
        common(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        QWEN2_TOKENIZER,
        CHATML_TEMPLATE,
        vocab_size=151936,
    ),
    "qwen3": FamilySpec(
        "Qwen3Config",
        "Qwen3ForCausalLM",  # q_norm / k_norm are built in
        common(
            head_dim=HEAD_DIM,
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        ),
        QWEN2_TOKENIZER,
        CHATML_TEMPLATE,
        vocab_size=151936,
    ),
    "gemma": FamilySpec(
        "GemmaConfig",
        "GemmaForCausalLM",  # (1 + w) norms and sqrt(hidden) embedding scale are built in
        common(
            head_dim=HEAD_DIM,
            hidden_act="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        SPM_GEMMA_TOKENIZER,
        GEMMA_TEMPLATE,
    ),
    "gemma2": FamilySpec(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        common(
            head_dim=HEAD_DIM,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            sliding_window=32,  # on even layers: the default layer_types alternate
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            # = head_dim as in Gemma 2 2B/9B: GGUF keeps no query_pre_attn_scalar (llama.cpp
            # derives it); tests/model/random_hf_models.py covers a scalar != head_dim.
            query_pre_attn_scalar=HEAD_DIM,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        SPM_GEMMA_TOKENIZER,
        GEMMA_TEMPLATE,
    ),
    "gemma3": FamilySpec(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",  # q_norm / k_norm are built in
        common(
            num_hidden_layers=6,  # five sliding-window layers, then a global one
            head_dim=HEAD_DIM,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            sliding_window=32,
            query_pre_attn_scalar=HEAD_DIM,  # GGUF keeps no scalar: llama.cpp uses head_dim
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        SPM_GEMMA_TOKENIZER,
        GEMMA_TEMPLATE,
    ),
    "phi3": FamilySpec(
        "Phi3Config",
        "Phi3ForCausalLM",  # fused qkv_proj and gate_up_proj
        common(
            tie_word_embeddings=False,
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "original_max_position_embeddings": 512,
                **longrope_factors(HIDDEN_SIZE // NUM_HEADS),
            },
        ),
        SPM_PHI3_TOKENIZER,
        PHI3_TEMPLATE,
    ),
    "phi4-mini": FamilySpec(
        "Phi3Config",
        "Phi3ForCausalLM",
        common(
            tie_word_embeddings=True,
            original_max_position_embeddings=512,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.75,
                "original_max_position_embeddings": 512,
                **longrope_factors(HIDDEN_SIZE // NUM_HEADS * 3 // 4),
            },
        ),
        SPM_PHI3_TOKENIZER,
        PHI3_TEMPLATE,
    ),
    "olmo2": FamilySpec(
        "Olmo2Config",
        "Olmo2ForCausalLM",  # q/k norms over all heads, norms after attention and MLP
        common(
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
        ),
        BpeRecipe(
            vocab="llama-bpe",  # its first 100256 tokens are cl100k, OLMo 2's base
            pre_tokenizer="llama3",
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token="<|endoftext|>",
            eos_token="<|endoftext|>",
            pad_token="<|pad|>",
            add_bos_token=False,
            num_base_tokens=100256,
            special_tokens={100257: "<|endoftext|>", 100277: "<|pad|>"},
            expected_pre="dbrx",
        ),
        OLMO2_TEMPLATE,
        vocab_size=100352,
    ),
    "granite": FamilySpec(
        "GraniteConfig",
        "GraniteForCausalLM",
        common(
            tie_word_embeddings=True,
            embedding_multiplier=12.0,
            attention_multiplier=0.03,  # instead of 1 / sqrt(head_dim) = 0.125
            residual_multiplier=0.22,
            logits_scaling=8.0,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        ),
        BpeRecipe(
            vocab="starcoder",
            pre_tokenizer="digits",
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token="<|end_of_text|>",
            eos_token="<|end_of_text|>",
            pad_token="<|end_of_text|>",
            add_bos_token=False,
            special_tokens={
                0: "<|end_of_text|>",
                49152: "<|start_of_role|>",
                49153: "<|end_of_role|>",
                49154: "<|tool_call|>",
            },
            expected_pre="starcoder",
        ),
        GRANITE_TEMPLATE,
        vocab_size=49155,
    ),
    "smollm3": FamilySpec(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",  # every 4th layer without RoPE (no_rope_layer_interval 4)
        common(
            tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 5000000.0},
        ),
        BpeRecipe(
            vocab="llama-bpe",
            pre_tokenizer="llama3",
            tokenizer_class="PreTrainedTokenizerFast",
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|im_end|>",
            add_bos_token=False,
            ignore_merges=True,
            special_tokens={128011: "<|im_start|>", 128012: "<|im_end|>"},
            # Llama 3's pre-tokenizer without a BOS token: the converter's name is smaug-bpe.
            expected_pre="smaug-bpe",
        ),
        CHATML_TEMPLATE,
        vocab_size=128256,
    ),
}


def llama_cpp_vocab_dir() -> Path:
    """llama.cpp's models/ directory (ggml-vocab-*.gguf), from the sdist the bench tools build
    from; fetched from PyPI on first use."""
    from benchmarks.llamacpp_build import ensure_source

    return ensure_source() / "models"


def build_tiny_model(family: str, directory: Path) -> Path:
    """Build `family`'s tiny model into `directory` (created; must not hold another model)."""
    import torch
    import transformers

    spec = FAMILIES[family]
    directory.mkdir(parents=True, exist_ok=True)
    if isinstance(spec.tokenizer, SpmRecipe):
        from tests.model.tiny_tokenizers import save_spm_tokenizer

        vocab_size = save_spm_tokenizer(spec.tokenizer, directory, spec.chat_template)
    else:
        from tests.model.tiny_tokenizers import save_bpe_tokenizer

        num_ids = save_bpe_tokenizer(
            spec.tokenizer, directory, spec.chat_template, llama_cpp_vocab_dir()
        )
        assert spec.vocab_size is not None and num_ids <= spec.vocab_size, family
        vocab_size = spec.vocab_size
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(directory))
    config_class = getattr(transformers, spec.config_class)
    config = config_class(
        vocab_size=vocab_size,
        # The tokenizer's, not the family defaults (Phi-3's pad is 32000).
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # A copy: config classes edit rope_parameters in place, which would change the spec
        # (and so its cache key) for the rest of the process.
        **copy.deepcopy(spec.config),
    )
    torch.manual_seed(SEED)
    model = getattr(transformers, spec.model_class)(config).to(torch.float32).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:
                parameter.add_(torch.randn_like(parameter) * 0.1)
    model.generation_config.do_sample = False
    model.save_pretrained(str(directory), safe_serialization=True)
    return directory


def spec_digest(family: str) -> str:
    """A short digest of everything that decides the built files."""
    import sentencepiece
    import tokenizers
    import transformers

    spec = FAMILIES[family]
    text = json.dumps(
        {
            "version": TINY_MODELS_VERSION,
            "spec": asdict(spec),
            "tokenizer": type(spec.tokenizer).__name__,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "sentencepiece": sentencepiece.__version__,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def tiny_models_cache_dir() -> Path:
    return cache_files.cache_root() / "tiny-models" / f"v{TINY_MODELS_VERSION}"


def tiny_model_dir(family: str, cache_root: Path | None = None) -> Path:
    """The family's tiny model, built once into the cache (keyed by family, version and a
    digest of the spec and library versions) and reused after."""
    root = cache_root or tiny_models_cache_dir()
    directory = root / f"{family}-{spec_digest(family)}" / "hf"
    if directory.is_dir():
        return directory

    def build(partial: Path) -> None:
        # Builds of an older spec of this family are stale: drop them (hundreds of MB each).
        for stale in root.glob(f"{family}-*"):
            if stale.name.rsplit("-", 1)[0] == family and stale != directory.parent:
                shutil.rmtree(stale, ignore_errors=True)
        build_tiny_model(family, partial)

    # One process builds it while the others wait; it appears whole.
    return cache_files.make_once(directory, build)
