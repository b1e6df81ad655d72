"""The batch-invariant runner path (ModelRunner.create(batch_invariant=True)) on the embedded
model in fp32 and bf16 (GGUF blocks, int8 activations): every linear layer switched, every
step through the fused C++ layers, and a prompt's logits the same whether its tokens were
prefilled in one step or prefilled in part and then decoded one by one (each token attends
over the cache as a decode query does; SDPA for the prefill, as eager steps without the mode
run it, fails this). The serving flag is --deterministic (tests/model/test_deterministic.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from services.contracts.errors import ModelLoadError
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.worker.batch_invariance import BatchInvariantLinear, make_batch_invariant
from services.worker.loaded_model import LoadedModel
from services.worker.model.causal_lm import CausalLM
from services.worker.quantization.gguf_linear import GGUFLinear
from services.worker.quantization.linear import Int8WeightOnlyLinear
from services.worker.runner import ModelRunner
from tests.kernels.test_llama_decode import tiny_config

PROMPT_LEN, DECODED = 27, 10
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=DECODED + 1, ignore_eos=True)


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def runner(request: pytest.FixtureRequest) -> ModelRunner:
    # A model of its own: the mode switches the layers of the model it is given.
    loaded = LoadedModel.load(None, request.param, "cpu", "auto")
    return ModelRunner.create(
        loaded, kv_cache_bytes=64 << 20, block_size=16, seed=0, batch_invariant=True
    )


def record_logits(runner: ModelRunner) -> list[torch.Tensor]:
    """The logits of every later step that samples, in order."""
    captured: list[torch.Tensor] = []
    original = runner._forward_sampled

    def record(forward):  # type: ignore[no-untyped-def]
        captured.append(original(forward).clone())
        return captured[-1]

    runner._forward_sampled = record  # type: ignore[method-assign]
    return captured


def test_every_linear_layer_is_switched_and_every_step_is_fused(runner: ModelRunner) -> None:
    linears = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert linears and all(m.batch_invariant for m in linears)
    assert runner.fused_decode is not None and runner.decode_graphs is None
    runner.reset()
    prompt = list(range(1000, 1000 + PROMPT_LEN))
    plan = BatchPlan(
        step_id=0,
        new_sequences=[NewSequence("prefill", prompt, PROMPT_LEN, [0, 1], 0, GREEDY)],
        num_scheduled_tokens={"prefill": PROMPT_LEN},
    )
    runner.execute(plan)
    assert runner.last_step_mode == "fused"
    runner.reset()


def test_one_step_prefill_equals_prefill_then_decodes(runner: ModelRunner) -> None:
    token_ids = list(range(1000, 1000 + PROMPT_LEN + DECODED))
    captured = record_logits(runner)
    runner.reset()
    whole = len(token_ids)
    runner.execute(
        BatchPlan(
            step_id=0,
            new_sequences=[NewSequence("one-step", token_ids, whole, [0, 1, 2], 0, GREEDY)],
            num_scheduled_tokens={"one-step": whole},
        )
    )
    one_step = captured[-1][0]
    runner.reset()
    prompt = token_ids[:PROMPT_LEN]
    runner.execute(
        BatchPlan(
            step_id=0,
            new_sequences=[NewSequence("decoded", prompt, PROMPT_LEN, [3, 4, 5], 0, GREEDY)],
            num_scheduled_tokens={"decoded": PROMPT_LEN},
        )
    )
    sequence = runner.batch.sequences["decoded"]
    for step in range(DECODED):
        sequence.token_ids[-1] = token_ids[PROMPT_LEN + step]  # our token, not the sampled one
        runner.execute(BatchPlan(step_id=1 + step, num_scheduled_tokens={"decoded": 1}))
    assert sequence.num_computed_tokens == whole
    assert torch.equal(captured[-1][0], one_step)


def test_formats_without_a_batch_invariant_path_are_refused() -> None:
    model = CausalLM(tiny_config(attention_bias=False))
    layer = model.layers[0].self_attn
    assert isinstance(layer.o_proj, nn.Linear)
    layer.o_proj = Int8WeightOnlyLinear.from_float(layer.o_proj.weight.data, None)
    with pytest.raises(ModelLoadError, match="Int8WeightOnlyLinear"):
        make_batch_invariant(model)


def test_float_layers_become_fixed_tile_layers_sharing_their_weights() -> None:
    model = CausalLM(tiny_config(attention_bias=True))
    weight = model.layers[1].mlp.down_proj.weight
    make_batch_invariant(model)
    layers = [m for m in model.modules() if isinstance(m, (nn.Linear, BatchInvariantLinear))]
    assert layers and all(isinstance(m, BatchInvariantLinear) for m in layers)
    assert model.layers[1].mlp.down_proj.weight is weight
    assert model.layers[0].self_attn.qkv_proj.bias is not None
