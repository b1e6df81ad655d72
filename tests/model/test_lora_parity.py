"""LoRA adapters on the worker against transformers + peft with the adapter merged
(`merge_and_unload()`), in float32: random adapters made offline with peft on the embedded
model (SmolLM2, Llama family, loaded from its GGUF) and on a tiny random Qwen2 (q/k/v
biases); one runner batch mixes four adapters and the base model, and each request's greedy
tokens equal the merged model's, its logits close. A GGUF LoRA file written by llama.cpp's
convert_lora_to_gguf.py gives what its PEFT source gives."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.worker.loaded_model import LoadedModel
from services.worker.runner import ModelRunner
from tests.model.random_hf_models import VOCAB_SIZE, build_random_hf_model, load_hf_reference

pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft")

NUM_NEW_TOKENS = 16
LOGITS_ATOL = 2e-3
BLOCK_SIZE = 16
ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    modules: tuple[str, ...]
    rslora: bool = False


# Four adapters of different ranks, targets and scalings; the fifth request runs the base.
SPECS = (
    AdapterSpec("all16", 16, 32.0, tuple(ALL_MODULES)),
    AdapterSpec("qv8", 8, 16.0, ("q_proj", "v_proj")),
    AdapterSpec("mlp4-rs", 4, 8.0, ("o_proj", "gate_proj", "up_proj", "down_proj"), rslora=True),
    AdapterSpec("kod16", 16, 16.0, ("k_proj", "o_proj", "down_proj")),
)


def make_adapter(base, spec: AdapterSpec, directory: Path, seed: int):  # type: ignore[no-untyped-def]
    """Save a random adapter of `base` (A and B random: peft would start B at zero) and
    return the reference: a copy of `base` with it merged."""
    config = peft.LoraConfig(
        r=spec.rank,
        lora_alpha=spec.alpha,
        target_modules=list(spec.modules),
        use_rslora=spec.rslora,
        init_lora_weights=False,
    )
    model = peft.get_peft_model(copy.deepcopy(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name:
                param.copy_(torch.randn(param.shape, generator=g) / param.shape[1] ** 0.5)
            elif "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=g) * 0.05)
    model.save_pretrained(str(directory))
    return model.merge_and_unload().eval()


def hf_greedy(model, ids: list[int]) -> list[int]:  # type: ignore[no-untyped-def]
    model.generation_config.eos_token_id = None
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=NUM_NEW_TOKENS, do_sample=False, pad_token_id=0
        )
    return list(out[0, len(ids) :].tolist())


def hf_last_logits(model, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float()


def lora_runner(loaded: LoadedModel, max_lora_rank: int = 16) -> ModelRunner:
    return ModelRunner.create(
        loaded,
        kv_cache_bytes=64 << 20,
        block_size=BLOCK_SIZE,
        seed=0,
        max_loras=4,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=4,
    )


def run_greedy(
    runner: ModelRunner, requests: list[tuple[list[int], str]], late: int = -1
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of every (prompt, adapter) request, all in one batch (request `late`
    joins at the third step: a step of prefill and decodes), through runner.execute; and the
    first prefill's last-position logits of each request, from the same batch."""
    greedy = SamplingParams(temperature=0.0, max_new_tokens=NUM_NEW_TOKENS, ignore_eos=True)
    blocks_each = -(-(max(len(p) for p, _ in requests) + NUM_NEW_TOKENS) // BLOCK_SIZE)
    sequences = [
        NewSequence(
            f"r{i}",
            prompt,
            len(prompt),
            list(range(i * blocks_each, (i + 1) * blocks_each)),
            0,
            greedy,
            lora_name=name,
        )
        for i, (prompt, name) in enumerate(requests)
    ]
    first = [s for i, s in enumerate(sequences) if i != late]
    logits = prefill_logits(runner, first)
    runner.reset()
    outputs: dict[str, list[int]] = {s.request_id: [] for s in sequences}
    waiting = [s for i, s in enumerate(sequences) if i == late]
    plan = BatchPlan(
        0, new_sequences=first, num_scheduled_tokens={s.request_id: len(s.token_ids) for s in first}
    )
    step = 0
    while any(len(out) < NUM_NEW_TOKENS for out in outputs.values()):
        result = runner.execute(plan)
        assert not result.failed_sequences
        for request_id, token_id in result.sampled_token_ids.items():
            outputs[request_id].append(token_id)
        step += 1
        scheduled = {rid: 1 for rid, out in outputs.items() if 0 < len(out) < NUM_NEW_TOKENS}
        joining = waiting if step == 2 else []
        scheduled |= {s.request_id: len(s.token_ids) for s in joining}
        plan = BatchPlan(step, new_sequences=joining, num_scheduled_tokens=scheduled)
    runner.reset()
    return [outputs[s.request_id] for s in sequences], logits


def prefill_logits(runner: ModelRunner, sequences: list[NewSequence]) -> list[torch.Tensor]:
    """Last-position logits of each sequence from one prefill batch (the forward the runner
    would run, its LoRA segment table included)."""
    plan = BatchPlan(
        0,
        new_sequences=sequences,
        num_scheduled_tokens={s.request_id: len(s.token_ids) for s in sequences},
    )
    plan, failed = runner.adapters.admit(plan)
    assert not failed
    runner.batch.apply(plan)
    inputs = runner.batch.prepare(plan)
    inputs.forward.lora = runner.adapters.batch_for(
        [s.request_id for s in inputs.sequences], inputs.row_counts, runner.device
    )
    assert inputs.forward.lora is not None
    with torch.inference_mode():
        logits = runner.model(inputs.forward, runner.kv_cache.layers)
    return list(logits)


def check_mixed_batch(
    loaded: LoadedModel, base, prompts: list[list[int]], tmp_path: Path
) -> ModelRunner:  # type: ignore[no-untyped-def]
    runner = lora_runner(loaded)
    references = []
    for seed, spec in enumerate(SPECS):
        directory = tmp_path / spec.name
        references.append(make_adapter(base, spec, directory, seed))
        info = runner.adapters.load(spec.name, directory)
        assert (info.rank, set(info.targets)) == (spec.rank, set(spec.modules))
    references.append(base)
    names = [spec.name for spec in SPECS] + [""]
    requests = list(zip(prompts, names, strict=True))
    tokens, logits = run_greedy(runner, requests, late=len(requests) - 1)
    base_tokens = hf_greedy(base, prompts[0])
    for reference, prompt, name, ours in zip(references, prompts, names, tokens, strict=True):
        assert ours == hf_greedy(reference, prompt), f"adapter {name or '(base)'}"
    for reference, prompt, name, ours in zip(references, prompts, names, logits, strict=False):
        theirs = hf_last_logits(reference, prompt)
        diff = (ours - theirs).abs().max().item()
        assert diff < LOGITS_ATOL * max(1.0, theirs.abs().max().item()), (name, diff)
    # The adapters matter: the first one's tokens are not the base model's.
    assert tokens[0] != base_tokens
    return runner


# --- the embedded model (Llama family) ---------------------------------------------------------


def test_embedded_model_mixed_adapters_match_merged_peft(
    loaded_fp32: LoadedModel, hf_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    encode = loaded_fp32.tokenizer.encode
    texts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village,",
        "List three colors:\n1.",
        "Water boils at a temperature of",
    ]
    runner = check_mixed_batch(loaded_fp32, hf_model, [encode(t) for t in texts], tmp_path)
    # A rank-16 adapter of all seven projections, loaded into slots already allocated.
    runner.adapters.unload("kod16")
    info = runner.adapters.load("all16-again", tmp_path / "all16")
    print(
        f"\nload of a rank-16 adapter (q,k,v,o,gate,up,down) on SmolLM2-135M: {info.load_ms:.1f} ms"
    )


# --- a tiny random Qwen2 (biases on q, k, v) ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def random_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def test_qwen2_mixed_adapters_match_merged_peft(qwen2_dir: Path, tmp_path: Path) -> None:
    loaded = LoadedModel.load(str(qwen2_dir), torch.float32)
    base = load_hf_reference(qwen2_dir)
    check_mixed_batch(loaded, base, random_prompts((37, 20, 45, 9, 28)), tmp_path)


# --- GGUF LoRA files from llama.cpp's converter ------------------------------------------------


def convert_lora(base_dir: Path, lora_dir: Path, out: Path) -> Path:
    from tests.model.gguf_convert import converter_env, llama_cpp_source

    try:
        source = llama_cpp_source()
    except Exception as exc:  # no network and no cached sources
        pytest.skip(f"llama.cpp sources unavailable: {exc}")
    command = [
        sys.executable,
        str(source / "convert_lora_to_gguf.py"),
        "--base",
        str(base_dir),
        "--outtype",
        "f32",
        "--outfile",
        str(out),
        str(lora_dir),
    ]
    done = subprocess.run(
        command, env=converter_env(source), capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def check_gguf_like_peft(
    loaded: LoadedModel, base, base_dir: Path, prompt: list[int], tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    spec = SPECS[0]  # every projection, q and k included (llama.cpp permutes their rows)
    peft_dir = tmp_path / "peft"
    make_adapter(base, spec, peft_dir, seed=7)
    gguf_file = convert_lora(base_dir, peft_dir, tmp_path / "adapter.gguf")
    runner = lora_runner(loaded)
    from_peft = runner.adapters.load("peft", peft_dir)
    from_gguf = runner.adapters.load("gguf", gguf_file)
    assert (from_gguf.rank, from_gguf.targets, from_gguf.scaling) == (
        from_peft.rank,
        from_peft.targets,
        from_peft.scaling,
    )
    slots = runner.adapters.slots
    assert slots is not None
    for projection, lora_a in slots.lora_a.items():
        torch.testing.assert_close(lora_a[:, 1], lora_a[:, 0], rtol=0, atol=0)
        torch.testing.assert_close(
            slots.lora_b[projection][:, 1], slots.lora_b[projection][:, 0], rtol=0, atol=0
        )
    tokens, _ = run_greedy(runner, [(prompt, "peft"), (prompt, "gguf")])
    assert tokens[0] == tokens[1]


def test_gguf_lora_of_the_embedded_model_gives_its_peft_source(
    loaded_fp32: LoadedModel, hf_model, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    base_dir = tmp_path / "base"
    # The converter reads only config.json: the base's, as a plain float Llama checkpoint's.
    config = hf_model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = ["LlamaForCausalLM"]
    base_dir.mkdir()
    (base_dir / "config.json").write_text(json.dumps(config))
    prompt = loaded_fp32.tokenizer.encode("The quick brown fox")
    check_gguf_like_peft(loaded_fp32, hf_model, base_dir, prompt, tmp_path)


def test_gguf_lora_of_qwen2_gives_its_peft_source(qwen2_dir: Path, tmp_path: Path) -> None:
    loaded = LoadedModel.load(str(qwen2_dir), torch.float32)
    base = load_hf_reference(qwen2_dir)
    check_gguf_like_peft(loaded, base, qwen2_dir, random_prompts((30,))[0], tmp_path)


def test_adapter_of_another_base_is_refused(
    loaded_fp32: LoadedModel, qwen2_dir: Path, tmp_path: Path
) -> None:
    base = load_hf_reference(qwen2_dir)
    make_adapter(base, SPECS[1], tmp_path / "qwen2-adapter", seed=0)
    runner = lora_runner(loaded_fp32)
    with pytest.raises(ValueError, match="another base model"):
        runner.adapters.load("x", tmp_path / "qwen2-adapter")
