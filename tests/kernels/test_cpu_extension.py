"""The C++ CPU kernels (kernels/csrc) against the torch references, on fresh random inputs.

Paged decode attention in fp32/bf16/fp16 and over int8 caches, the KV-cache write (bit-exact),
the scalar fallback (forced at run time), both ops inside a torch.compile graph, and opcheck.
Inputs look like the worker's: caches are views of one [layers, 2, ...] storage, queries, keys
and values are strided views of a fused qkv output, block tables are wider than needed (the
unused columns hold ids outside the cache, so reading one fails).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from kernels import attention_torch, cpu_extension, kv_cache_torch, ops

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-5},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
}
FLOAT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
GQA = [(4, 4), (9, 3), (8, 1)]
UNUSED_BLOCK = 2**30  # in block-table columns past a sequence's length


@pytest.fixture(scope="module")
def extension():  # type: ignore[no-untyped-def]
    assert cpu_extension.load(), "the C++ kernels must build on this machine (gcc, ninja)"
    return cpu_extension.ops()


@pytest.fixture
def scalar_kernels(extension) -> Iterator[None]:  # type: ignore[no-untyped-def]
    """Runs the test on the portable scalar kernels instead of the SIMD ones."""
    previous = extension.set_scalar_kernels(True)
    try:
        assert extension.cpu_kernel_isa() == "scalar"
        yield
    finally:
        extension.set_scalar_kernels(previous)


@dataclass(slots=True)
class DecodeCase:
    query: Tensor  # [B, Hq, D], a strided view of a fused qkv output
    k_cache: Tensor  # views of layer 1 of a [2, 2, num_blocks, block_size, Hkv, D] storage
    v_cache: Tensor
    block_tables: Tensor  # [B, W] int32, UNUSED_BLOCK past each sequence's blocks
    context_lens: Tensor  # [B] int32, 0 = padding row
    k_scale: Tensor | None
    v_scale: Tensor | None

    @property
    def scale(self) -> float:
        return float(self.query.shape[-1] ** -0.5)

    def args(self) -> tuple:
        return (
            self.query,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.context_lens,
            self.scale,
            self.k_scale,
            self.v_scale,
        )

    def reference(self) -> Tensor:
        """The torch op on the non-padding rows; zeros for padding rows."""
        valid = self.context_lens > 0
        out = torch.zeros(self.query.shape, dtype=self.query.dtype)
        if bool(valid.any()):
            # The torch op gathers every column up to the longest context: hand it real ids.
            tables = self.block_tables[valid].clamp(max=self.k_cache.shape[0] - 1)
            out[valid] = attention_torch.paged_decode_attention(
                self.query[valid].contiguous(),
                self.k_cache,
                self.v_cache,
                tables,
                self.context_lens[valid],
                self.scale,
                self.k_scale,
                self.v_scale,
            )
        return out


def fused_qkv_views(
    num_tokens: int,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, Hq, D], k and v [T, Hkv, D] as views into one [T, (Hq + 2 Hkv) * D] tensor."""
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=generator).to(dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        q.view(num_tokens, num_q_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )


def make_decode_case(
    lengths: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    generator: torch.Generator,
    block_size: int = 16,
    quant_group: int | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> DecodeCase:
    blocks_needed = [-(-n // block_size) for n in lengths]
    width = max(blocks_needed) + 3
    num_blocks = sum(blocks_needed) + 5
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    storage = torch.randn(shape, generator=generator)
    k_scale = v_scale = None
    if quant_group is None:
        storage = storage.to(dtype)
    else:
        codes, scales = kv_cache_torch.quantize_kv_int8(storage, quant_group, scale_dtype)
        # Own allocations (quantize returns reshaped views): the views' _base is the storage.
        storage, scales = codes.clone(), scales.clone()
        k_scale, v_scale = scales[1, 0], scales[1, 1]
    order = torch.randperm(num_blocks, generator=generator).int()
    block_tables = torch.full((len(lengths), width), UNUSED_BLOCK, dtype=torch.int32)
    used = 0
    for row, n in enumerate(blocks_needed):
        block_tables[row, :n] = order[used : used + n]
        used += n
    query, _, _ = fused_qkv_views(
        len(lengths), num_q_heads, num_kv_heads, head_dim, dtype, generator
    )
    return DecodeCase(
        query,
        storage[1, 0],
        storage[1, 1],
        block_tables,
        torch.tensor(lengths, dtype=torch.int32),
        k_scale,
        v_scale,
    )


def check_decode(extension, case: DecodeCase, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    got = extension.paged_decode_attention(*case.args())
    assert got.dtype == case.query.dtype and got.shape == case.query.shape
    assert got.is_contiguous()
    expected = case.reference()
    torch.testing.assert_close(got.float(), expected.float(), **TOLERANCES[dtype])
    padding = case.context_lens == 0
    assert bool((got[padding] == 0).all()), "a padding row must be zeros"


def seeded(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(hash(key) % 2**31)


LENGTHS = [[1], [17, 0, 40, 16], [129, 3, 64, 1, 0]]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("lengths", LENGTHS)
def test_paged_decode_attention_matches_torch(
    extension,
    dtype: torch.dtype,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
    lengths: list[int],
) -> None:  # type: ignore[no-untyped-def]
    g = seeded(dtype, head_dim, num_q_heads, len(lengths))
    case = make_decode_case(lengths, num_q_heads, num_kv_heads, head_dim, dtype, g)
    check_decode(extension, case, dtype)


@pytest.mark.parametrize("block_size", [1, 5, 32])
def test_paged_decode_attention_any_block_size(extension, block_size: int) -> None:  # type: ignore[no-untyped-def]
    g = seeded("block", block_size)
    case = make_decode_case([70, 1, 33], 9, 3, 64, torch.float32, g, block_size=block_size)
    check_decode(extension, case, torch.float32)


@pytest.mark.parametrize("quant_group", [8, 16, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(9, 3), (8, 1)])
def test_paged_decode_attention_int8_cache(
    extension,
    quant_group: int,
    dtype: torch.dtype,
    head_dim: int,
    num_q_heads: int,
    num_kv_heads: int,
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("int8", quant_group, dtype, head_dim, num_q_heads)
    case = make_decode_case(
        [33, 0, 1, 100], num_q_heads, num_kv_heads, head_dim, dtype, g, quant_group=quant_group
    )
    check_decode(extension, case, dtype)


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "quant_group"),
    [
        (16, 1, 64, None),  # GQA group 16: two tiles of 8 query heads
        (12, 1, 64, 8),  # a tile of 8 and one of 4
        (4, 2, 36, None),  # head_dim no vector width divides: the scalar backend
        (4, 2, 36, 4),
        (9, 3, 64, 2),  # int8 groups smaller than a vector: lane permutes
        (9, 3, 64, 4),
        (9, 3, 128, 32),
        (4, 2, 48, 16),
    ],
)
def test_unusual_shapes(
    extension, num_q_heads: int, num_kv_heads: int, head_dim: int, quant_group: int | None
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("unusual", num_q_heads, head_dim, quant_group)
    for dtype in (torch.float32, torch.bfloat16):
        case = make_decode_case(
            [45, 0, 3], num_q_heads, num_kv_heads, head_dim, dtype, g, quant_group=quant_group
        )
        check_decode(extension, case, dtype)
        cache_dtype = dtype if quant_group is None else torch.int8
        check_write(extension, g, dtype, cache_dtype, quant_group, num_kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_paged_decode_attention_int8_scale_dtypes(extension, scale_dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    g = seeded("scale dtype", scale_dtype)
    case = make_decode_case(
        [50, 7], 9, 3, 64, torch.float32, g, quant_group=8, scale_dtype=scale_dtype
    )
    check_decode(extension, case, torch.float32)


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Long contexts split across threads only when there is more than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@pytest.mark.parametrize(
    ("dtype", "quant_group"),
    [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None), (torch.float32, 8)],
)
@pytest.mark.parametrize("lengths", [[2100], [2500, 7, 0, 2049]])
def test_paged_decode_attention_long_context_split(
    extension, two_threads: None, dtype: torch.dtype, quant_group: int | None, lengths: list[int]
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("long", dtype, quant_group, len(lengths))
    case = make_decode_case(lengths, 9, 3, 64, dtype, g, quant_group=quant_group)
    check_decode(extension, case, dtype)
    # One thread never splits: the merged result must agree with the unsplit one, and both
    # must repeat exactly (no order-dependent sums across threads).
    split = extension.paged_decode_attention(*case.args())
    assert torch.equal(split, extension.paged_decode_attention(*case.args()))
    torch.set_num_threads(1)
    unsplit = extension.paged_decode_attention(*case.args())
    torch.testing.assert_close(unsplit.float(), split.float(), **TOLERANCES[dtype])


def test_paged_decode_attention_rejects_bad_tables(extension) -> None:  # type: ignore[no-untyped-def]
    case = make_decode_case([20], 4, 4, 64, torch.float32, seeded("bad"))
    case.block_tables[0, 1] = case.k_cache.shape[0]  # used (token 16..19) and out of range
    with pytest.raises(RuntimeError, match="outside the cache"):
        extension.paged_decode_attention(*case.args())
    case.context_lens[0] = case.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="does not fit"):
        extension.paged_decode_attention(*case.args())


# --- scalar fallback -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "quant_group", "lengths"),
    [
        (torch.float32, None, [17, 0, 40, 1]),
        (torch.bfloat16, None, [129, 3]),
        (torch.float16, None, [64]),
        (torch.float32, 8, [33, 1, 0]),
        (torch.bfloat16, 64, [70]),
        (torch.float32, None, [2100, 5]),
    ],
)
def test_scalar_fallback_attention(
    extension,
    scalar_kernels: None,
    two_threads: None,
    dtype: torch.dtype,
    quant_group: int | None,
    lengths: list[int],
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("scalar", dtype, quant_group, len(lengths))
    case = make_decode_case(lengths, 9, 3, 64, dtype, g, quant_group=quant_group)
    check_decode(extension, case, dtype)


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "quant_group"),
    [
        (torch.bfloat16, torch.bfloat16, None),
        (torch.float32, torch.float16, None),
        (torch.float32, torch.int8, 8),
        (torch.bfloat16, torch.int8, 64),
    ],
)
def test_scalar_fallback_write(
    extension,
    scalar_kernels: None,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    quant_group: int | None,
) -> None:  # type: ignore[no-untyped-def]
    check_write(
        extension, seeded("scalar write", dtype, cache_dtype), dtype, cache_dtype, quant_group
    )


# --- KV-cache write --------------------------------------------------------------------------


def check_write(
    extension,
    g: torch.Generator,
    dtype: torch.dtype,
    cache_dtype: torch.dtype,
    quant_group: int | None,
    num_kv_heads: int = 3,
    head_dim: int = 64,
    scale_dtype: torch.dtype = torch.float16,
    num_tokens: int = 11,
) -> None:  # type: ignore[no-untyped-def]
    block_size, num_blocks = 16, 9
    _, key, value = fused_qkv_views(num_tokens, 9, num_kv_heads, head_dim, dtype, g)
    key[2].zero_()  # an all-zero row: scale 0, codes 0
    key[3, 0, :8] = 1e-30  # a scale that rounds to 0 in fp16
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[[1, 5]] = -1  # padding tokens
    shape = (2, 2, num_blocks, block_size, num_kv_heads, head_dim)
    if cache_dtype == torch.int8:
        assert quant_group is not None
        storage = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        scale_shape = (*shape[:-1], head_dim // quant_group)
        scales = torch.rand(scale_shape, generator=g).to(scale_dtype)
    else:
        storage = torch.randn(shape, generator=g).to(cache_dtype)
        scales = None
    expected_storage, expected_scales = storage.clone(), None if scales is None else scales.clone()

    def layer(t: Tensor | None, kv: int) -> Tensor | None:
        return None if t is None else t[1, kv]

    real = slots >= 0  # the torch op has no padding slots
    kv_cache_torch.write_kv_cache(
        key[real],
        value[real],
        expected_storage[1, 0],
        expected_storage[1, 1],
        slots[real],
        layer(expected_scales, 0),
        layer(expected_scales, 1),
    )
    extension.write_kv_cache(
        key, value, storage[1, 0], storage[1, 1], slots, layer(scales, 0), layer(scales, 1)
    )
    assert torch.equal(storage, expected_storage), "cache differs (every layer, K and V checked)"
    if scales is not None:
        assert expected_scales is not None
        assert torch.equal(scales, expected_scales), "scales differ"


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("cache_dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_float_matches_torch(
    extension, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("write", dtype, cache_dtype, head_dim)
    check_write(extension, g, dtype, cache_dtype, None, head_dim=head_dim)


@pytest.mark.parametrize("quant_group", [8, 16, 64])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("scale_dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_write_kv_cache_int8_is_bit_exact(
    extension, quant_group: int, dtype: torch.dtype, scale_dtype: torch.dtype, head_dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("write int8", quant_group, dtype, scale_dtype, head_dim)
    check_write(
        extension, g, dtype, torch.int8, quant_group, head_dim=head_dim, scale_dtype=scale_dtype
    )


def test_write_kv_cache_many_tokens_in_parallel(extension) -> None:  # type: ignore[no-untyped-def]
    """A prefill-sized write (enough rows for the parallel path)."""
    g = seeded("write many")
    check_write(extension, g, torch.bfloat16, torch.int8, 8, num_tokens=140)
    check_write(extension, g, torch.bfloat16, torch.bfloat16, None, num_tokens=140)


def test_int8_rounds_half_to_even(extension) -> None:  # type: ignore[no-untyped-def]
    """Codes exactly halfway between two integers: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> 0."""
    head_dim = 8
    row = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5])  # scale exactly 1.0
    key = row.view(1, 1, head_dim)
    k_cache = torch.zeros(1, 1, 1, head_dim, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    k_scale = torch.zeros(1, 1, 1, 1, dtype=torch.float16)
    v_scale = torch.zeros_like(k_scale)
    extension.write_kv_cache(
        key, key, k_cache, v_cache, torch.zeros(1, dtype=torch.int64), k_scale, v_scale
    )
    assert k_cache.flatten().tolist() == [127, 0, 2, 2, 0, -2, -2, 4]
    assert k_scale.item() == 1.0


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
