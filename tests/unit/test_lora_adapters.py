"""LoRA adapters on the worker (services/worker/lora/), on a tiny made-up Llama shape and
hand-written PEFT directories: the batched apply against a dense per-row reference, the
segment table, the fused projections' block layout, slots and host copies (LRU, sequences
holding slots), the refusals naming their field, and the gRPC status of each control call."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file

from kernels.lora_torch import lora_apply
from protos.llmserve.v1 import lora_pb2
from services.contracts.sampling_params import SamplingParams
from services.contracts.step import BatchPlan, NewSequence
from services.worker.lora.adapters import LoraAdapters
from services.worker.lora.batch import lora_batch, segment_table
from services.worker.lora.errors import LoraAdapterError, LoraConflictError, LoraNotFoundError
from services.worker.model.architecture import ModelArchitecture
from tests.unit.test_worker_controller import FakeRunner, worker

ARCH = ModelArchitecture(
    family="llama",
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
# module -> (out, in) of the tiny shape
SHAPES = {
    "self_attn.q_proj": (16, 16),
    "self_attn.k_proj": (8, 16),
    "self_attn.v_proj": (8, 16),
    "self_attn.o_proj": (16, 16),
    "mlp.gate_proj": (32, 16),
    "mlp.up_proj": (32, 16),
    "mlp.down_proj": (16, 32),
}
ALL_MODULES = tuple(SHAPES)


def write_peft(
    directory: Path,
    modules: tuple[str, ...] = ALL_MODULES,
    *,
    rank: int = 4,
    alpha: float = 8.0,
    num_layers: int = 2,
    hidden_scale: int = 1,
    seed: int = 0,
    **config: object,
) -> Path:
    """A PEFT LoRA directory as peft's save_pretrained writes it."""
    directory.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for module in modules:
            out, in_ = SHAPES[module]
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_ * hidden_scale, generator=g)
            tensors[f"{key}.lora_B.weight"] = torch.randn(out * hidden_scale, rank, generator=g)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    settings = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": [m.rpartition(".")[2] for m in modules],
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "modules_to_save": None,
        **config,
    }
    (directory / "adapter_config.json").write_text(json.dumps(settings))
    return directory


def adapters(max_loras: int = 2, max_cpu_loras: int = 4, max_rank: int = 8) -> LoraAdapters:
    return LoraAdapters(
        ARCH,
        torch.float32,
        torch.device("cpu"),
        max_loras=max_loras,
        max_lora_rank=max_rank,
        max_cpu_loras=max_cpu_loras,
    )


def new_sequence(request_id: str, lora_name: str = "") -> NewSequence:
    return NewSequence(request_id, [1, 2, 3], 3, [0], 0, SamplingParams(), lora_name=lora_name)


def admit(manager: LoraAdapters, *sequences: NewSequence, finished: tuple[str, ...] = ()):  # type: ignore[no-untyped-def]
    plan = BatchPlan(
        0,
        new_sequences=list(sequences),
        num_scheduled_tokens={s.request_id: 3 for s in sequences},
        finished_request_ids=list(finished),
    )
    return manager.admit(plan)


# --- the apply ---------------------------------------------------------------------------


def test_apply_adds_each_rows_adapter_and_leaves_base_rows() -> None:
    g = torch.Generator().manual_seed(0)
    slots, rank, d_in, d_out = 3, 5, 7, 6
    lora_a = torch.randn(slots, rank, d_in, generator=g)
    lora_b = torch.randn(slots, d_out, rank, generator=g)
    scales = torch.tensor([0.5, 2.0, 1.5])
    x = torch.randn(9, d_in, generator=g)
    y = torch.randn(9, d_out, generator=g)
    row_slots = [1, 1, 1, -1, -1, 0, 0, 0, 0]
    starts, seg_slots = segment_table([(3, 1), (2, -1), (4, 0)])
    expected = y.clone()
    for row, slot in enumerate(row_slots):
        if slot >= 0:
            expected[row] += scales[slot] * (lora_b[slot] @ (lora_a[slot] @ x[row]))
    lora_apply(
        x,
        lora_a,
        lora_b,
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor(seg_slots, dtype=torch.int32),
        scales,
        y,
    )
    torch.testing.assert_close(y, expected)


def test_segment_table_merges_neighbours_of_one_slot() -> None:
    starts, slots = segment_table([(3, 2), (2, -1), (1, 2), (1, 2), (0, 1), (1, 0)])
    assert starts == [0, 3, 5, 7, 8]
    assert slots == [2, -1, 2, 0]


def test_fused_projections_add_each_parts_own_delta(tmp_path: Path) -> None:
    """q and v targeted, k not: the qkv output's k rows are untouched; q and v rows get
    scaling * B @ A of their own pair (the block-diagonal layout of slots.py)."""
    manager = adapters()
    path = write_peft(tmp_path / "qv", ("self_attn.q_proj", "self_attn.v_proj"), rank=3)
    manager.load("qv", path)
    from safetensors.torch import load_file

    weights = load_file(str(path / "adapter_model.safetensors"))
    _, failed = admit(manager, new_sequence("r", "qv"))
    assert not failed
    batch = manager.batch_for(["r"], [4], torch.device("cpu"))
    assert batch is not None
    x = torch.randn(4, 16)
    y = torch.zeros(4, 32)
    batch.layer(1).add("qkv", x, y)
    prefix = "base_model.model.model.layers.1.self_attn"
    scaling = 8.0 / 3

    def delta(module: str) -> torch.Tensor:
        a = weights[f"{prefix}.{module}.lora_A.weight"]
        b = weights[f"{prefix}.{module}.lora_B.weight"]
        return scaling * x @ (b @ a).T

    torch.testing.assert_close(y[:, :16], delta("q_proj"))
    assert torch.count_nonzero(y[:, 16:24]) == 0
    torch.testing.assert_close(y[:, 24:], delta("v_proj"))


def test_a_batch_without_adapter_rows_gets_no_table(tmp_path: Path) -> None:
    manager = adapters()
    manager.load("a", write_peft(tmp_path / "a"))
    assert manager.batch_for(["x"], [3], torch.device("cpu")) is None  # no sequence holds one
    admit(manager, new_sequence("base"), new_sequence("r", "a"))
    assert manager.batch_for(["base"], [3], torch.device("cpu")) is None
    batch = manager.batch_for(["base", "r"], [3, 1], torch.device("cpu"))
    assert batch is not None
    assert batch.seg_starts.tolist() == [0, 3, 4]
    assert batch.seg_slots.tolist() == [-1, 0]


# --- slots, host copies, sequences ------------------------------------------------------------


def test_slots_are_taken_over_least_recently_used_and_never_from_running_sequences(
    tmp_path: Path,
) -> None:
    manager = adapters(max_loras=2)
    for name in ("a", "b", "c"):
        write_peft(tmp_path / name, seed=ord(name))
    assert manager.load("a", tmp_path / "a").slot == 0
    assert manager.load("b", tmp_path / "b").slot == 1
    _, failed = admit(manager, new_sequence("ra", "a"), new_sequence("rb", "b"))
    assert not failed
    # Both slots are held: c waits in host memory, and a sequence of c fails alone.
    assert manager.load("c", tmp_path / "c").slot == -1
    plan, failed = admit(manager, new_sequence("rc", "c"), new_sequence("base"))
    assert list(failed) == ["rc"] and "slots are used by running sequences" in failed["rc"]
    assert [s.request_id for s in plan.new_sequences] == ["base"]
    assert list(plan.num_scheduled_tokens) == ["base"]
    # A failed sequence stays out of every plan until the scheduler drops it.
    later = manager.admit(BatchPlan(1, num_scheduled_tokens={"rc": 1, "base": 1}))[0]
    assert list(later.num_scheduled_tokens) == ["base"]
    # b's sequence ends: c takes over b's slot (a is still running).
    _, failed = admit(manager, new_sequence("rc2", "c"), finished=("rb", "rc"))
    assert not failed
    assert manager.info("c").slot == 1 and manager.info("b").slot == -1
    assert manager.info("c").num_running == 1


def test_switching_between_adapters_in_their_slots_writes_no_slot(tmp_path: Path) -> None:
    """Sequences of adapters already in slots, coming and going in any order, cost no copy
    into the slots (the target: switching adapters costs no step)."""
    manager = adapters(max_loras=2)
    for name in ("a", "b"):
        manager.load(name, write_peft(tmp_path / name, seed=ord(name)))
    assert manager.slots is not None
    writes: list[int] = []
    write = manager.slots.write
    manager.slots.write = lambda slot, adapter: (writes.append(slot), write(slot, adapter))[1]  # type: ignore[method-assign]
    finished: tuple[str, ...] = ()
    for step in range(6):
        name = "ab"[step % 2]
        admit(
            manager, new_sequence(f"r{step}", name), new_sequence(f"base{step}"), finished=finished
        )
        finished = (f"r{step}", f"base{step}")
    assert writes == []
    assert {manager.info("a").slot, manager.info("b").slot} == {0, 1}


def test_unload_refuses_an_adapter_in_use(tmp_path: Path) -> None:
    manager = adapters()
    manager.load("a", write_peft(tmp_path / "a"))
    admit(manager, new_sequence("r", "a"))
    with pytest.raises(LoraConflictError, match="used by 1 running sequences"):
        manager.unload("a")
    admit(manager, finished=("r",))
    manager.unload("a")
    assert manager.list() == []
    with pytest.raises(LoraNotFoundError):
        manager.unload("a")


def test_an_unknown_adapter_fails_its_sequence_with_the_name(tmp_path: Path) -> None:
    plan, failed = admit(adapters(), new_sequence("r", "nope"), new_sequence("base"))
    assert failed == {"r": "lora_name: no adapter 'nope' is loaded on this worker"}
    assert [s.request_id for s in plan.new_sequences] == ["base"]


def test_host_copies_beyond_max_cpu_loras_are_read_again(tmp_path: Path) -> None:
    manager = adapters(max_loras=1, max_cpu_loras=1)
    manager.load("a", write_peft(tmp_path / "a", seed=1))
    manager.load("b", write_peft(tmp_path / "b", seed=2))  # takes a's slot and host place
    assert manager.info("a").slot == -1
    _, failed = admit(manager, new_sequence("r", "a"))  # read again from its directory
    assert not failed and manager.info("a").slot == 0
    assert manager.slots is not None
    assert manager.slots.scales[0].item() == 2.0


def test_a_worker_without_slots_refuses_loads(tmp_path: Path) -> None:
    with pytest.raises(LoraConflictError, match="max_loras is 0"):
        adapters(max_loras=0, max_cpu_loras=0).load("a", write_peft(tmp_path / "a"))


# --- refusals ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("config", "field", "words"),
    [
        ({"use_dora": True}, "use_dora", "DoRA"),
        ({"bias": "all"}, "bias", "'all'"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save", "whole modules"),
        ({"target_modules": ["q_proj", "lm_head"]}, "target_modules", "'lm_head'"),
        ({"rank_pattern": {"q_proj": 2}}, "rank_pattern", "per-module ranks"),
        ({"peft_type": "IA3"}, "peft_type", "'IA3'"),
    ],
)
def test_unsupported_peft_fields_are_refused_by_name(
    tmp_path: Path, config: dict[str, object], field: str, words: str
) -> None:
    with pytest.raises(LoraAdapterError) as refused:
        adapters().load("x", write_peft(tmp_path / "x", **config))  # type: ignore[arg-type]
    assert refused.value.field == field
    assert words in str(refused.value)


def test_an_adapter_of_another_base_is_refused_with_the_shapes(tmp_path: Path) -> None:
    with pytest.raises(LoraAdapterError, match="another base model") as refused:
        adapters().load("x", write_peft(tmp_path / "x", hidden_scale=2))
    assert refused.value.field == "shapes"
    with pytest.raises(LoraAdapterError, match="has 2 layers") as refused:
        adapters().load("y", write_peft(tmp_path / "y", num_layers=3))
    assert refused.value.field == "layers"


def test_rank_over_the_limit_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoraAdapterError, match="rank 16 is over this worker's max_lora_rank 8"):
        adapters(max_rank=8).load("x", write_peft(tmp_path / "x", rank=16))


def test_dora_tensors_are_refused_even_without_the_flag(tmp_path: Path) -> None:
    path = write_peft(tmp_path / "x")
    weights = {
        "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": torch.ones(16)
    }
    save_file(weights, str(path / "adapter_model.safetensors"))
    with pytest.raises(LoraAdapterError, match="DoRA"):
        adapters().load("x", path)


def test_scaling_is_alpha_over_rank_or_over_its_root_with_rslora(tmp_path: Path) -> None:
    manager = adapters()
    assert manager.load("plain", write_peft(tmp_path / "p", rank=4, alpha=8)).scaling == 2.0
    info = manager.load("rs", write_peft(tmp_path / "r", rank=4, alpha=8, use_rslora=True))
    assert info.scaling == 4.0
    assert info.targets == (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )


# --- the gRPC control calls ----------------------------------------------------------------


class AdapterRunner(FakeRunner):
    def __init__(self) -> None:
        super().__init__()
        self.adapters = adapters()


def test_control_calls_answer_with_their_status(tmp_path: Path) -> None:
    asyncio.run(control_calls(tmp_path))


async def control_calls(tmp_path: Path) -> None:
    runner = AdapterRunner()
    good = write_peft(tmp_path / "good")
    dora = write_peft(tmp_path / "dora", use_dora=True)
    async with worker(runner) as stub:  # type: ignore[arg-type]
        info = await stub.LoadLoraAdapter(
            lora_pb2.LoadLoraAdapterRequest(name="good", path=str(good))
        )
        assert (info.name, info.rank, info.slot) == ("good", 4, 0)
        assert list(info.targets)[:3] == ["q_proj", "k_proj", "v_proj"]
        assert info.load_ms > 0
        codes = []
        for name, path in (("good", good), ("dora", dora), ("gone", tmp_path / "missing")):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.LoadLoraAdapter(
                    lora_pb2.LoadLoraAdapterRequest(name=name, path=str(path))
                )
            codes.append(refused.value.code())
        assert codes == [
            grpc.StatusCode.ALREADY_EXISTS,
            grpc.StatusCode.INVALID_ARGUMENT,
            grpc.StatusCode.INVALID_ARGUMENT,
        ]
        listed = await stub.ListLoraAdapters(lora_pb2.ListLoraAdaptersRequest())
        assert [a.name for a in listed.adapters] == ["good"]

        runner.adapters.admit(BatchPlan(0, new_sequences=[new_sequence("r", "good")]))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.UnloadLoraAdapter(lora_pb2.UnloadLoraAdapterRequest(name="good"))
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        runner.adapters.admit(BatchPlan(1, finished_request_ids=["r"]))
        await stub.UnloadLoraAdapter(lora_pb2.UnloadLoraAdapterRequest(name="good"))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.UnloadLoraAdapter(lora_pb2.UnloadLoraAdapterRequest(name="good"))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_lora_batch_tensors_are_int32(tmp_path: Path) -> None:
    manager = adapters()
    manager.load("a", write_peft(tmp_path / "a"))
    assert manager.slots is not None
    batch = lora_batch([(2, 0), (1, -1)], manager.slots, torch.device("cpu"))
    assert batch.seg_starts.dtype == batch.seg_slots.dtype == torch.int32


def test_a_batch_unrolls_its_segments_to_row_slots(tmp_path: Path) -> None:
    """What a compiled step's bucket takes: one slot per row, neighbours merged or not."""
    manager = adapters()
    manager.load("a", write_peft(tmp_path / "a"))
    assert manager.slots is not None
    batch = lora_batch([(1, 0), (1, 0), (1, -1), (1, 0)], manager.slots, torch.device("cpu"))
    assert batch.seg_slots.tolist() == [0, -1, 0]
    row_slots = batch.row_slots(4)
    assert row_slots.dtype == torch.int32 and row_slots.tolist() == [0, 0, -1, 0]
