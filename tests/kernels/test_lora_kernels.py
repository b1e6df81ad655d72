"""Batched multi-LoRA: the torch reference against a token-by-token fp64 loop over the
unpadded adapters, then the C++ ops (SIMD and scalar), the Triton kernels (interpreter) and
kernels.ops against the torch reference, on fresh random inputs.

Cases: ranks 1, 5, 7, 8, 12, 16 and 64 zero-padded to max ranks 12, 16 and 64; decode (one
token per segment), prefill (long segments) and mixed layouts with slot -1, shared slots,
empty segments and tokens past the last segment; fused q|k|v and gate|up outputs
(out_slices, a q-only adapter). Rows of tokens without an adapter must stay bitwise equal.

Tolerances (atol = rtol): fp32 1e-5, fp16 2e-3, bf16 2e-2 (y rounds once to its dtype; the
fp32 sums differ in order only); the fp32 intermediate 1e-5.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kernels import backend, cpu_extension, lora_torch, ops
from tests.kernels.lora_cases import (
    LAYOUTS,
    RANKS,
    check_against_reference,
    exact_output,
    make_case,
)

FUSED = {"plain": None, "qkv": [48, 16, 16], "gate_up": [40, 40]}


def gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---- the torch reference ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_reference_matches_fp64(layout: str, ranks: str, fused: str, dtype: torch.dtype) -> None:
    case = make_case(
        layout, ranks, dtype, gen("ref", layout, ranks, fused), out_slices=FUSED[fused]
    )
    y = case.y.clone()
    lora_torch.lora_apply(
        case.x,
        case.lora_a,
        case.lora_b,
        case.seg_starts,
        case.seg_slots,
        case.scales,
        y,
        case.out_slices,
    )
    want = exact_output(case)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), want, atol=1e-5, rtol=1e-5)
    else:  # the inputs are exact bf16 values; only the final rounding and fp32 sums differ
        torch.testing.assert_close(y.double(), want.to(dtype).double(), atol=2e-2, rtol=2e-2)
    touched = case.touched_rows()
    assert torch.equal(y[~touched], case.y[~touched])


# ---- the C++ ops ---------------------------------------------------------------------

needs_extension = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ CPU kernels here")


def _cpp_ops() -> tuple:  # type: ignore[type-arg]
    llmserve = torch.ops.llmserve
    return (
        llmserve.lora_shrink,
        lambda v, b, starts, slots, scales, y, out_slices: llmserve.lora_expand(
            v, b, starts, slots, scales, y, out_slices or []
        ),
        lambda x, a, b, starts, slots, scales, y, out_slices: llmserve.lora_apply(
            x, a, b, starts, slots, scales, y, out_slices or []
        ),
    )


@needs_extension
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", list(FUSED))
@pytest.mark.parametrize("ranks", list(RANKS))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cpu_matches_reference(layout: str, ranks: str, fused: str, dtype: torch.dtype) -> None:
    case = make_case(
        layout, ranks, dtype, gen("cpu", layout, ranks, fused), out_slices=FUSED[fused]
    )
    check_against_reference(case, *_cpp_ops())


@needs_extension
@pytest.mark.parametrize(
    ("in_features", "out_features", "out_slices"),
    [(576, 576, None), (100, 203, None), (576, 1536 * 2, [1536, 1536]), (64, 203, [101, 51, 51])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_model_shapes_and_tails(
    in_features: int,
    out_features: int,
    out_slices: list[int] | None,
    dtype: torch.dtype,
    two_threads: None,
) -> None:
    """SmolLM2-135M's projections, and K / N / slices that are not multiples of the vector
    width (the scalar shrink, tail rows of the expand); two threads split the work."""
    for layout in ("decode", "prefill", "mixed"):
        g = gen("cpu shapes", in_features, out_features, layout)
        case = make_case(
            layout,
            "r16",
            dtype,
            g,
            in_features=in_features,
            out_features=out_features,
            out_slices=out_slices,
        )
        check_against_reference(case, *_cpp_ops())


@needs_extension
@pytest.mark.usefixtures("scalar_kernels")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["decode", "mixed"])
def test_cpu_scalar_backend_matches_reference(layout: str, dtype: torch.dtype) -> None:
    case = make_case(layout, "r64", dtype, gen("scalar", layout), out_slices=[48, 16, 16])
    check_against_reference(case, *_cpp_ops())


@needs_extension
def test_cpu_ops_pass_opcheck() -> None:
    case = make_case("mixed", "r16", torch.float32, gen("opcheck"), out_slices=[40, 40])
    args = (case.x, case.lora_a, case.seg_starts, case.seg_slots, case.intermediate())
    torch.library.opcheck(torch.ops.llmserve.lora_shrink.default, args)
    v = case.reference_intermediate()
    expand_args = (
        v,
        case.lora_b,
        case.seg_starts,
        case.seg_slots,
        case.scales,
        case.y.clone(),
        [40, 40],
    )
    torch.library.opcheck(torch.ops.llmserve.lora_expand.default, expand_args)
    apply_args = (
        case.x,
        case.lora_a,
        case.lora_b,
        case.seg_starts,
        case.seg_slots,
        case.scales,
        case.y.clone(),
        [40, 40],
    )
    torch.library.opcheck(torch.ops.llmserve.lora_apply.default, apply_args)


@needs_extension
@pytest.mark.parametrize(
    ("starts", "slots", "match"),
    [
        ([0, 3, 2], [0, 0], "must not decrease"),
        ([0, 3, 40], [0, 1], "num_tokens"),
        ([0, 3, 5], [0, 4], r"seg_slots\[1\] = 4"),
        ([0, 3, 5], [-2, 0], r"seg_slots\[0\] = -2"),
    ],
)
def test_cpu_bad_segments_raise(starts: list[int], slots: list[int], match: str) -> None:
    case = make_case("mixed", "r16", torch.float32, gen("bad"))
    seg_starts = torch.tensor(starts, dtype=torch.int32)
    seg_slots = torch.tensor(slots, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.llmserve.lora_shrink(
            case.x, case.lora_a, seg_starts, seg_slots, case.intermediate()
        )
    with pytest.raises(lora_torch.LoraShapeError, match=match):
        lora_torch.lora_shrink(case.x, case.lora_a, seg_starts, seg_slots, case.intermediate())


# ---- the Triton kernels (interpreter: fp32 and fp16, no bf16) ----------------------------


@pytest.mark.usefixtures("poisoned")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fused", ["plain", "qkv"])
@pytest.mark.parametrize("ranks", ["r64", "r12"])
@pytest.mark.parametrize("layout", ["decode", "prefill", "mixed", "no adapter", "no segment"])
def test_triton_matches_reference(layout: str, ranks: str, fused: str, dtype: torch.dtype) -> None:
    from kernels import triton_lora

    case = make_case(
        layout, ranks, dtype, gen("triton", layout, ranks, fused), out_slices=FUSED[fused]
    )

    def shrink(*args: torch.Tensor) -> None:
        triton_lora.lora_shrink(*args, block_k=32)  # K = 96: three K tiles

    def expand(*args: object) -> None:
        triton_lora.lora_expand(*args, block_n=32)  # type: ignore[arg-type]

    check_against_reference(case, shrink, expand, None)


# ---- kernels.ops ---------------------------------------------------------------------


@pytest.mark.parametrize("backend_name", ["torch", "triton", "cpu_extension"])
def test_ops_reach_every_backend(backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if backend_name == "cpu_extension":
        if not cpu_extension.load():
            pytest.skip("no C++ CPU kernels here")
        monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(backend.BACKEND_ENV_VAR, backend_name)
    case = make_case(
        "mixed", "r16", torch.float32, gen("ops", backend_name), out_slices=[48, 16, 16]
    )
    check_against_reference(case, ops.lora_shrink, ops.lora_expand, ops.lora_apply)


def _bad_calls(case) -> dict[str, tuple]:  # type: ignore[no-untyped-def,type-arg]
    v = case.intermediate()
    a, b, starts, slots, scales, y = (
        case.lora_a,
        case.lora_b,
        case.seg_starts,
        case.seg_slots,
        case.scales,
        case.y.clone(),
    )
    return {
        "x": (ops.lora_shrink, (case.x.int(), a, starts, slots, v)),
        "lora_a": (ops.lora_shrink, (case.x, a[:, :, :-1], starts, slots, v)),
        "out": (ops.lora_shrink, (case.x, a, starts, slots, v.double())),
        "seg_starts": (ops.lora_shrink, (case.x, a, starts.long(), slots, v)),
        "seg_slots": (ops.lora_shrink, (case.x, a, starts, slots.long(), v)),
        "lora_b": (ops.lora_expand, (v, b.float()[:, :-1], starts, slots, scales, y)),
        "scales": (ops.lora_expand, (v, b, starts, slots, scales[:-1], y)),
        "v": (ops.lora_expand, (v[:, :-1], b, starts, slots, scales, y)),
        "y": (ops.lora_expand, (v, b, starts, slots, scales, y.t())),
        "out_slices": (ops.lora_expand, (v, b, starts, slots, scales, y, [40, 41])),
        "lora_a's rank": (
            ops.lora_apply,
            (case.x, a, b[:, :, :-1].contiguous(), starts, slots, scales, y),
        ),
    }


@pytest.mark.parametrize(
    "name", list(_bad_calls(make_case("mixed", "r16", torch.float32, gen("names"))))
)
def test_bad_shapes_and_dtypes_raise_naming_the_argument(name: str) -> None:
    case = make_case("mixed", "r16", torch.bfloat16, gen("bad shapes"))
    op, args = _bad_calls(case)[name]
    with pytest.raises(lora_torch.LoraShapeError, match=name):
        op(*args)


@needs_extension
def test_benchmark_runs_at_tiny_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import kernels_lora

    tiny = "--batch 3 --adapters 1 2 --hidden 32 --intermediate 48 --kv 16 --budget-s 0"
    kernels_lora.main([*tiny.split(), "--repeats", "1"])
    table = capsys.readouterr().out
    assert "| gate_up | 2 |" in table and "apply / base" in table
