"""LoRA adapters on the worker against transformers + peft with the adapter merged
(`merge_and_unload()`), in float32: random adapters made offline with peft on the embedded
model (SmolLM2, Llama family, loaded from its GGUF: dequantized, and as its own blocks) and on
a tiny random Qwen2 (q/k/v biases); one runner batch mixes four adapters and the base model,
and each request's greedy tokens equal the merged model's, its logits close. The decode steps
run on each path a worker has (eager torch ops, the fused C++ step, compiled graphs), every
one of them on the path under test, with the adapter rows in its batches. A GGUF LoRA file
written by llama.cpp's convert_lora_to_gguf.py gives what its PEFT source gives."""

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
from services.worker.forward_batch import ForwardBatch
from services.worker.loaded_model import LoadedModel
from services.worker.runner import ModelRunner, StepMode
from services.worker.step_graphs import DecodeGraphs
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


# A compiled runner's one bucket: every decode batch below (1 to 5 sequences) fits it, the
# rest of its rows padding; a bucket set's worth of graphs would take minutes to compile.
COMPILED_BUCKET = 8


def lora_runner(
    loaded: LoadedModel, path: StepMode = "fused", max_lora_rank: int = 16
) -> ModelRunner:
    """A runner with four LoRA slots whose decode steps take `path`."""
    runner = ModelRunner.create(
        loaded,
        kv_cache_bytes=64 << 20,
        block_size=BLOCK_SIZE,
        seed=0,
        max_loras=4,
        max_lora_rank=max_lora_rank,
        max_cpu_loras=4,
        fused_decode=path == "fused",
        enforce_eager=path != "compiled",
        max_num_seqs=COMPILED_BUCKET,
        lora_graphs=True,
    )
    assert (runner.fused_decode is not None) == (path == "fused")
    if path == "compiled":
        graphs = runner.decode_graphs
        assert graphs is not None and graphs.lora_slots is runner.adapters.slots
        runner.decode_graphs = DecodeGraphs(
            runner.model,
            runner.kv_cache,
            max_model_len=graphs.max_blocks_per_seq * BLOCK_SIZE,
            buckets=[COMPILED_BUCKET],
            lora_slots=graphs.lora_slots,
        )
        runner.decode_graphs.compile_all(show_progress=False)
    return runner


def spy_on_decode_path(runner: ModelRunner) -> list[bool]:
    """For each step the runner's fused step or compiled graphs run from now on: whether its
    batch had LoRA rows."""
    seen: list[bool] = []
    path = runner.fused_decode or runner.decode_graphs
    if path is None:
        return seen
    run = path.run

    def recording(batch: ForwardBatch) -> torch.Tensor:
        seen.append(batch.lora is not None)
        return run(batch)

    path.run = recording  # type: ignore[method-assign]
    return seen


def run_greedy(
    runner: ModelRunner,
    requests: list[tuple[list[int], str]],
    late: int = -1,
    decode_modes: list[str] | None = None,
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens of every (prompt, adapter) request, all in one batch (request `late`
    joins at the third step: a step of prefill and decodes), through runner.execute; and the
    first prefill's last-position logits of each request, from the same batch. The path each
    pure-decode step took goes to `decode_modes`."""
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
        pure_decode = set(plan.num_scheduled_tokens.values()) == {1} and not plan.new_sequences
        if pure_decode and decode_modes is not None:
            decode_modes.append(runner.last_step_mode)
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


@dataclass
class MixedBatch:
    """Four adapters (SPECS, saved under their names) and the base model, one prompt each, and
    what the merged references answer."""

    directory: Path
    prompts: list[list[int]]
    names: list[str]
    """SPECS' names, then "" (the base model)."""
    tokens: list[list[int]]
    """Each merged reference's greedy tokens."""
    logits: list[torch.Tensor]
    """Each merged reference's last-position logits of its prompt."""
    base_tokens: list[int]
    """The base model's greedy tokens of the first prompt."""


def mixed_batch(base, prompts: list[list[int]], directory: Path) -> MixedBatch:  # type: ignore[no-untyped-def]
    references = [
        make_adapter(base, spec, directory / spec.name, seed) for seed, spec in enumerate(SPECS)
    ]
    references.append(base)
    return MixedBatch(
        directory,
        prompts,
        [spec.name for spec in SPECS] + [""],
        [hf_greedy(r, p) for r, p in zip(references, prompts, strict=True)],
        [hf_last_logits(r, p) for r, p in zip(references, prompts, strict=True)],
        hf_greedy(base, prompts[0]),
    )


def check_mixed_batch(loaded: LoadedModel, case: MixedBatch, path: StepMode) -> ModelRunner:
    runner = lora_runner(loaded, path)
    for spec in SPECS:
        info = runner.adapters.load(spec.name, case.directory / spec.name)
        assert (info.rank, set(info.targets)) == (spec.rank, set(spec.modules))
    requests = list(zip(case.prompts, case.names, strict=True))
    seen = spy_on_decode_path(runner)
    modes: list[str] = []
    tokens, logits = run_greedy(runner, requests, late=len(requests) - 1, decode_modes=modes)
    for name, want, ours in zip(case.names, case.tokens, tokens, strict=True):
        assert ours == want, f"adapter {name or '(base)'} on the {path} path"
    # The late request has no logits here (not in the first prefill).
    for name, theirs, ours in zip(case.names, case.logits, logits, strict=False):
        diff = (ours - theirs).abs().max().item()
        assert diff < LOGITS_ATOL * max(1.0, theirs.abs().max().item()), (name, diff)
    # The adapters matter: the first one's tokens are not the base model's.
    assert tokens[0] != case.base_tokens
    # Every decode step took the path, most of them with adapter rows (the base request,
    # joining late, runs the last steps alone).
    assert modes and set(modes) == {path}, modes
    if path != "eager":
        assert len(seen) == len(modes) and seen.count(True) == len(modes) - 2, seen
    return runner


PATHS: list[StepMode] = ["eager", "fused"]


# --- the embedded model (Llama family) ---------------------------------------------------------

EMBEDDED_TEXTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "List three colors:\n1.",
    "Water boils at a temperature of",
]


@pytest.fixture(scope="module")
def embedded_batch(
    loaded_fp32: LoadedModel, hf_model, tmp_path_factory: pytest.TempPathFactory
) -> MixedBatch:  # type: ignore[no-untyped-def]
    prompts = [loaded_fp32.tokenizer.encode(text) for text in EMBEDDED_TEXTS]
    return mixed_batch(hf_model, prompts, tmp_path_factory.mktemp("embedded-adapters"))


@pytest.mark.parametrize("path", PATHS)
def test_embedded_model_mixed_adapters_match_merged_peft(
    loaded_fp32: LoadedModel, embedded_batch: MixedBatch, path: StepMode
) -> None:
    runner = check_mixed_batch(loaded_fp32, embedded_batch, path)
    # A rank-16 adapter of all seven projections, loaded into slots already allocated.
    runner.adapters.unload("kod16")
    info = runner.adapters.load("all16-again", embedded_batch.directory / "all16")
    print(
        f"\nload of a rank-16 adapter (q,k,v,o,gate,up,down) on SmolLM2-135M: {info.load_ms:.1f} ms"
    )


def test_embedded_gguf_blocks_mixed_adapters_match_merged_peft_fused(
    embedded_batch: MixedBatch,
) -> None:
    """The model as its file's own blocks (exact fp32 products): the fused step reads them
    and adds the adapters."""
    loaded = LoadedModel.load(None, torch.float32, quantization="gguf-exact")
    check_mixed_batch(loaded, embedded_batch, "fused")


# --- a tiny random Qwen2 (biases on q, k, v) ---------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_random_hf_model("qwen2", tmp_path_factory.mktemp("qwen2"))


def random_prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def qwen2_batch(qwen2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> MixedBatch:
    base = load_hf_reference(qwen2_dir)
    prompts = random_prompts((37, 20, 45, 9, 28))
    return mixed_batch(base, prompts, tmp_path_factory.mktemp("qwen2-adapters"))


@pytest.mark.parametrize("path", [*PATHS, "compiled"])
def test_qwen2_mixed_adapters_match_merged_peft(
    qwen2_dir: Path, qwen2_batch: MixedBatch, path: StepMode
) -> None:
    check_mixed_batch(LoadedModel.load(str(qwen2_dir), torch.float32), qwen2_batch, path)


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
