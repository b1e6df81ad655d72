"""The C++ paged decode attention against the torch reference: fp32/bf16/fp16, int8 caches,
unusual shapes, long contexts split across threads, and the scalar fallback."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cpu_extension_cases import (
    FLOAT_DTYPES,
    GQA,
    TOLERANCES,
    check_decode,
    check_write,
    make_decode_case,
    seeded,
)

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
