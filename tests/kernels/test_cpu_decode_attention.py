"""The C++ paged decode attention against the torch reference: fp32/bf16/fp16, int8 caches,
unusual shapes, long contexts split across threads, sliding windows and soft-capped logits,
and the scalar fallback."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.cpu_extension_cases import (
    FLOAT_DTYPES,
    GQA,
    TOLERANCES,
    UNUSED_BLOCK,
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


@pytest.mark.parametrize("cache_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(9, 3), (8, 1), (4, 4)])
def test_a_float32_query_reads_a_half_precision_cache(
    extension, cache_dtype: torch.dtype, num_q_heads: int, num_kv_heads: int
) -> None:  # type: ignore[no-untyped-def]
    """A float32 model over a float16 cache (what `--quantization gguf` uses by default): the
    query stays float32 and each cached value widens exactly, so the result is float32's."""
    g = seeded("half-cache", cache_dtype, num_q_heads)
    case = make_decode_case(
        [33, 0, 1, 300], num_q_heads, num_kv_heads, 64, torch.float32, g, cache_dtype=cache_dtype
    )
    assert case.k_cache.dtype == cache_dtype
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


@pytest.mark.parametrize(
    ("dtype", "cache_dtype", "quant_group"),
    [
        (torch.float32, torch.float16, None),
        (torch.bfloat16, None, None),
        (torch.float32, None, 8),
    ],
)
@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(32, 8), (9, 3), (12, 4), (8, 1)])
@pytest.mark.parametrize(
    ("lengths", "batch_invariant"),
    # The default mode splits a context by the batch's tokens and the threads: only one short
    # enough to stay one range keeps one thread's ranges.
    [([256], True), ([300, 17], True), ([1100], True), ([128], False)],
)
def test_heads_split_across_threads_change_no_bit(
    extension,
    two_threads: None,
    dtype: torch.dtype,
    cache_dtype: torch.dtype | None,
    quant_group: int | None,
    num_q_heads: int,
    num_kv_heads: int,
    lengths: list[int],
    batch_invariant: bool,
) -> None:  # type: ignore[no-untyped-def]
    """Few token ranges for the threads (one user, a context under one invariant split): the
    KV heads are cut across the threads. Each head's arithmetic is its own, so the result is
    one thread's (no head split), bit for bit."""
    g = seeded("heads", dtype, quant_group, num_q_heads, len(lengths), lengths[0])
    case = make_decode_case(
        lengths,
        num_q_heads,
        num_kv_heads,
        64,
        dtype,
        g,
        quant_group=quant_group,
        cache_dtype=cache_dtype,
        sliding_window=200 if len(lengths) == 2 else 0,
    )
    args = (*case.args()[:8], batch_invariant, *case.args()[9:])
    split = extension.paged_decode_attention(*args)
    torch.testing.assert_close(split.float(), case.reference().float(), **TOLERANCES[dtype])
    torch.set_num_threads(1)
    assert torch.equal(split, extension.paged_decode_attention(*args))


def test_paged_decode_attention_rejects_bad_tables(extension) -> None:  # type: ignore[no-untyped-def]
    case = make_decode_case([20], 4, 4, 64, torch.float32, seeded("bad"))
    case.block_tables[0, 1] = case.k_cache.shape[0]  # used (token 16..19) and out of range
    with pytest.raises(RuntimeError, match="outside the cache"):
        extension.paged_decode_attention(*case.args())
    case.context_lens[0] = case.block_tables.shape[1] * 16 + 1
    with pytest.raises(RuntimeError, match="does not fit"):
        extension.paged_decode_attention(*case.args())


# --- sliding window and soft-capped logits ----------------------------------------------------

WINDOW_LENGTHS = [129, 3, 64, 1, 0, 40, 17]


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("sliding_window", [1, 7, 16, 100, 5000])
@pytest.mark.parametrize("logit_softcap", [0.0, 1.5])
def test_sliding_window_and_softcap_match_torch(
    extension, dtype: torch.dtype, sliding_window: int, logit_softcap: float
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("window", dtype, sliding_window, logit_softcap)
    case = make_decode_case(
        WINDOW_LENGTHS,
        9,
        3,
        64,
        dtype,
        g,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    check_decode(extension, case, dtype)


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_sliding_window_gqa_shapes(
    extension, num_q_heads: int, num_kv_heads: int, head_dim: int
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("window gqa", num_q_heads, head_dim)
    case = make_decode_case(
        WINDOW_LENGTHS,
        num_q_heads,
        num_kv_heads,
        head_dim,
        torch.bfloat16,
        g,
        sliding_window=20,
        logit_softcap=3.0,
    )
    check_decode(extension, case, torch.bfloat16)


@pytest.mark.parametrize("quant_group", [8, 64])
@pytest.mark.parametrize("logit_softcap", [0.0, 0.1, 2.0])
def test_sliding_window_int8_cache(extension, quant_group: int, logit_softcap: float) -> None:  # type: ignore[no-untyped-def]
    """A cap of 0.1 saturates tanh (scores are ~10 caps): the exp(2|x|) branch at its clamp."""
    g = seeded("window int8", quant_group, logit_softcap)
    case = make_decode_case(
        [33, 0, 1, 100],
        9,
        3,
        64,
        torch.float32,
        g,
        quant_group=quant_group,
        sliding_window=24,
        logit_softcap=logit_softcap,
    )
    check_decode(extension, case, torch.float32)


def test_window_and_softcap_change_the_result(extension) -> None:  # type: ignore[no-untyped-def]
    case = make_decode_case([90, 40], 4, 2, 64, torch.float32, seeded("changes"))
    full = extension.paged_decode_attention(*case.args())
    case.sliding_window = 30
    windowed = extension.paged_decode_attention(*case.args())
    case.sliding_window, case.logit_softcap = 0, 1.0
    capped = extension.paged_decode_attention(*case.args())
    assert (windowed - full).abs().max() > 0.05 and (capped - full).abs().max() > 0.05


def test_blocks_before_the_window_are_not_read(extension) -> None:  # type: ignore[no-untyped-def]
    """Table entries before a window are neither validated nor read: an id outside the cache
    there changes nothing (an engine may free those blocks)."""
    case = make_decode_case([70, 50, 5], 9, 3, 64, torch.float32, seeded("skip"), sliding_window=16)
    want = extension.paged_decode_attention(*case.args())
    case.block_tables[0, :3] = UNUSED_BLOCK  # window 54..69: blocks 3 and 4
    case.block_tables[1, :2] = UNUSED_BLOCK  # window 34..49: blocks 2 and 3
    assert torch.equal(extension.paged_decode_attention(*case.args()), want)
    case.block_tables[0, 3] = UNUSED_BLOCK  # the first block the window reads
    with pytest.raises(RuntimeError, match="outside the cache"):
        extension.paged_decode_attention(*case.args())


@pytest.mark.parametrize(("dtype", "quant_group"), [(torch.float32, None), (torch.bfloat16, 8)])
@pytest.mark.parametrize("sliding_window", [700, 3000])
def test_sliding_window_long_context_split(
    extension, two_threads: None, dtype: torch.dtype, quant_group: int | None, sliding_window: int
) -> None:  # type: ignore[no-untyped-def]
    """A window of 700 on a 2100-token context is split across threads from position 1400."""
    g = seeded("window long", dtype, quant_group, sliding_window)
    case = make_decode_case(
        [2100, 7, 0, 900],
        9,
        3,
        64,
        dtype,
        g,
        quant_group=quant_group,
        sliding_window=sliding_window,
        logit_softcap=2.0,
    )
    check_decode(extension, case, dtype)
    split = extension.paged_decode_attention(*case.args())
    torch.set_num_threads(1)
    unsplit = extension.paged_decode_attention(*case.args())
    torch.testing.assert_close(unsplit.float(), split.float(), **TOLERANCES[dtype])


def test_rejects_negative_window_and_cap(extension) -> None:  # type: ignore[no-untyped-def]
    case = make_decode_case([5], 4, 4, 64, torch.float32, seeded("negative"))
    case.sliding_window = -1
    with pytest.raises(RuntimeError, match="sliding_window"):
        extension.paged_decode_attention(*case.args())
    case.sliding_window, case.logit_softcap = 0, -1.0
    with pytest.raises(RuntimeError, match="logit_softcap"):
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
@pytest.mark.parametrize(("sliding_window", "logit_softcap"), [(0, 0.0), (20, 1.5)])
def test_scalar_fallback_attention(
    extension,
    scalar_kernels: None,
    two_threads: None,
    dtype: torch.dtype,
    quant_group: int | None,
    lengths: list[int],
    sliding_window: int,
    logit_softcap: float,
) -> None:  # type: ignore[no-untyped-def]
    g = seeded("scalar", dtype, quant_group, len(lengths))
    case = make_decode_case(
        lengths,
        9,
        3,
        64,
        dtype,
        g,
        quant_group=quant_group,
        sliding_window=sliding_window,
        logit_softcap=logit_softcap,
    )
    check_decode(extension, case, dtype)
