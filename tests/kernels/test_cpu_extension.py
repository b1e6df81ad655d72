"""The C++ CPU kernels as torch ops: inside a torch.compile graph, under opcheck, chosen by
kernels.ops on CPU, and writing into views of one cache storage."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import torch
from torch import Tensor

from kernels import kv_cache_torch, ops
from tests.kernels.cpu_extension_cases import (
    DecodeCase,
    fused_qkv_views,
    make_decode_case,
    seeded,
)

# --- torch.compile and opcheck ---------------------------------------------------------------


def _decode_step(
    key: Tensor,
    value: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> Tensor:
    torch.ops.llmserve.write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    out = torch.ops.llmserve.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, 0.125, k_scale, v_scale
    )
    return out * 2.0  # something for inductor to fuse after the op


def _decode_step_via_ops(
    key: Tensor,
    value: Tensor,
    query: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    k_scale: Tensor | None,
    v_scale: Tensor | None,
) -> Tensor:
    """The same through kernels.ops, whose backend choice must trace without a graph break."""
    ops.write_kv_cache(key, value, k_cache, v_cache, slots, k_scale, v_scale)
    out = ops.paged_decode_attention(
        query, k_cache, v_cache, block_tables, context_lens, 0.125, k_scale, v_scale
    )
    return out * 2.0


@pytest.mark.parametrize("step", [_decode_step, _decode_step_via_ops])
@pytest.mark.parametrize("quant_group", [None, 8])
def test_ops_under_torch_compile(extension, step, quant_group: int | None) -> None:  # type: ignore[no-untyped-def]
    g = seeded("compile", quant_group)
    case = make_decode_case([30, 17, 0], 9, 3, 64, torch.bfloat16, g, quant_group=quant_group)
    _, key, value = fused_qkv_views(3, 9, 3, 64, torch.bfloat16, g)
    # Each sequence's next token goes to the slot after its context; the padding row writes none.
    lens = case.context_lens.tolist()
    slots = torch.tensor(
        [int(case.block_tables[b, n // 16]) * 16 + n % 16 if n else -1 for b, n in enumerate(lens)]
    )
    case.context_lens += (case.context_lens > 0).int()

    def run(fn, kv: DecodeCase) -> Tensor:  # type: ignore[no-untyped-def]
        return fn(
            key,
            value,
            kv.query,
            kv.k_cache,
            kv.v_cache,
            slots,
            kv.block_tables,
            kv.context_lens,
            kv.k_scale,
            kv.v_scale,
        )

    def clone(kv: DecodeCase) -> DecodeCase:
        # Clone the whole storage so the caches stay views with an offset, as in the worker.
        k_base = kv.k_cache._base
        v_scale_base = None if kv.k_scale is None else kv.k_scale._base
        assert k_base is not None
        storage = k_base.clone()
        scales = None if v_scale_base is None else v_scale_base.clone()
        return DecodeCase(
            kv.query,
            storage[1, 0],
            storage[1, 1],
            kv.block_tables,
            kv.context_lens,
            None if scales is None else scales[1, 0],
            None if scales is None else scales[1, 1],
        )

    eager_case, compiled_case = clone(case), clone(case)
    eager = run(step, eager_case)
    compiled_fn = torch.compile(step, backend="inductor", fullgraph=True)
    compiled = run(compiled_fn, compiled_case)
    torch.testing.assert_close(compiled, eager, atol=0, rtol=0)
    assert torch.equal(compiled_case.k_cache._base, eager_case.k_cache._base)
    if quant_group is not None:
        assert torch.equal(compiled_case.k_scale._base, eager_case.k_scale._base)
    torch._dynamo.reset()


@pytest.mark.parametrize("quant_group", [None, 8])
def test_opcheck(extension, quant_group: int | None) -> None:  # type: ignore[no-untyped-def]
    g = seeded("opcheck", quant_group)
    case = make_decode_case([20, 5], 4, 2, 64, torch.float32, g, quant_group=quant_group)
    args = case.args()
    torch.library.opcheck(torch.ops.llmserve.paged_decode_attention.default, args)
    _, key, value = fused_qkv_views(4, 4, 2, 64, torch.float32, g)
    slots = torch.tensor([3, -1, 40, 17])
    write_args = (key, value, args[1], args[2], slots, args[6], args[7])
    torch.library.opcheck(torch.ops.llmserve.write_kv_cache.default, write_args)


def test_ops_use_the_extension_on_cpu(extension, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    from kernels import backend

    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    assert backend.use_cpu_extension(torch.zeros(1))
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "torch")
    assert not backend.use_cpu_extension(torch.zeros(1))


# --- one cache per call (what the model's layers use) ----------------------------------------


@pytest.mark.parametrize("int8", [False, True])
def test_write_cache_writes_only_its_own_half(extension, int8: bool) -> None:  # type: ignore[no-untyped-def]
    """K and V are views of one storage, as in the worker; writing K leaves V untouched."""
    g = torch.Generator().manual_seed(7)
    dtype = torch.int8 if int8 else torch.float32
    storage = torch.zeros(2, 8, 4, 3, 16, dtype=dtype)
    scales = torch.zeros(2, 8, 4, 3, 2, dtype=torch.float16) if int8 else None
    key = torch.randn(5, 3, 16, generator=g)
    slots = torch.tensor([0, 5, -1, 17, 31])
    k_scale = None if scales is None else scales[0]
    extension.write_cache(key, storage[0], slots, k_scale)
    expected_k = torch.zeros(8, 4, 3, 16, dtype=dtype)
    expected_scale = None if scales is None else torch.zeros(8, 4, 3, 2, dtype=torch.float16)
    kv_cache_torch.write_kv_cache(
        key[[0, 1, 3, 4]],
        key[[0, 1, 3, 4]],
        expected_k,
        expected_k.clone(),
        slots[[0, 1, 3, 4]],
        expected_scale,
        None if expected_scale is None else expected_scale.clone(),
    )
    assert torch.equal(storage[0], expected_k)
    assert not storage[1].any()
    if scales is not None:
        assert expected_scale is not None
        assert torch.equal(scales[0], expected_scale) and not scales[1].any()


def test_compiled_write_into_views_of_one_storage_equals_eager(extension) -> None:  # type: ignore[no-untyped-def]
    """The worker's layout (K and V halves of one tensor) through kernels.ops, compiled."""
    g = torch.Generator().manual_seed(11)
    key, value = (torch.randn(3, 3, 64, generator=g) for _ in range(2))
    query = torch.randn(3, 9, 64, generator=g)
    slots = torch.tensor([3, 40, -1])
    block_tables = torch.tensor([[0, 1, 2], [2, 0, 1], [1, 2, 0]], dtype=torch.int32)
    context_lens = torch.tensor([4, 9, 0], dtype=torch.int32)

    def step(storage: Tensor) -> Tensor:
        return _decode_step_via_ops(
            key, value, query, storage[0], storage[1], slots, block_tables, context_lens, None, None
        )

    eager_storage = torch.randn(2, 3, 16, 3, 64, generator=g)
    compiled_storage = eager_storage.clone()
    want = step(eager_storage)
    got = torch.compile(step, fullgraph=True)(compiled_storage)
    torch.testing.assert_close(got, want)
    assert torch.equal(compiled_storage, eager_storage)


# --- instruction-set variants ----------------------------------------------------------------


def test_the_loaded_build_is_the_best_variant_this_cpu_runs() -> None:
    from kernels import cpu_extension

    assert cpu_extension.load()
    variant = cpu_extension.best_variant(cpu_extension.cpu_flags())
    assert cpu_extension.loaded_variant() == variant.name
    ops_namespace = cpu_extension.ops()
    expected = {
        "avx512": ("avx512", "avx512+vnni"),
        "avx2-vnni": ("avx2", "avx2+vnni"),
        "avx2": ("avx2", "avx2"),
    }
    expected["baseline"] = ("scalar", "scalar")
    assert (ops_namespace.cpu_kernel_isa(), ops_namespace.gguf_kernel_isa()) == expected[
        variant.name
    ]


def test_every_variant_builds_here_without_being_loaded() -> None:
    """An image builds every variant on one machine; the ones this CPU cannot run must still
    compile (they are not loaded: their code may use instructions this CPU lacks)."""
    from kernels import cpu_extension

    for variant in cpu_extension.VARIANTS:
        if variant.name == cpu_extension.loaded_variant():
            continue
        path = cpu_extension.build_only(variant)
        assert path.is_file() and path.stat().st_size > 100_000
        if variant.name == "avx2-vnni" and shutil.which("objdump"):
            # Its reason to exist: the VEX vpdpbusd in the GGUF dot products.
            listing = subprocess.run(
                ["objdump", "-d", "--no-show-raw-insn", str(path)],
                capture_output=True,
                text=True,
                check=True,
            ).stdout
            assert "vpdpbusd" in listing and "zmm" not in listing
