"""The C++ token-bitmask kernel (kernels/csrc/token_bitmask.cpp) against xgrammar's own apply
on fresh random masks: every row or some, words all-zero, all-one and mixed, a vocabulary
shorter than the logits and than the bitmask's words; rows not listed stay untouched."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, ops

pytestmark = pytest.mark.skipif(not cpu_extension.load(), reason="no C++ CPU kernels here")


def random_bitmask(rows: int, words: int, generator: torch.Generator) -> torch.Tensor:
    bitmask = torch.randint(
        -(2**31), 2**31 - 1, (rows, words), dtype=torch.int32, generator=generator
    )
    kinds = torch.randint(0, 3, (rows, words), generator=generator)
    bitmask[kinds == 0] = 0  # a grammar's usual word: nothing allowed
    bitmask[kinds == 1] = -1  # everything allowed
    return bitmask


@pytest.mark.parametrize(
    ("rows", "width", "vocab_size", "listed"),
    [
        (16, 49152, 49152, "all"),
        (5, 1000, 1000, "some"),
        (3, 1024, 1000, "all"),  # padded logits: tokens past the vocabulary left alone
        (4, 77, 70, "some"),
        (1, 33, 33, "all"),
    ],
)
def test_matches_xgrammar(rows: int, width: int, vocab_size: int, listed: str) -> None:
    import xgrammar as xgr

    generator = torch.Generator().manual_seed(rows * width + vocab_size)
    words = (width + 31) // 32
    logits = torch.randn(rows, width, generator=generator)
    bitmask = random_bitmask(rows, words, generator)
    indices = list(range(rows)) if listed == "all" else list(range(0, rows, 2))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, vocab_size=vocab_size, indices=indices)
    ours = logits.clone()
    assert ops.apply_token_bitmask(ours, bitmask, indices, vocab_size)
    torch.testing.assert_close(ours, expected, rtol=0, atol=0)
    unlisted = [row for row in range(rows) if row not in indices]
    assert torch.equal(ours[unlisted], logits[unlisted])


def test_other_dtypes_are_left_to_the_caller() -> None:
    logits = torch.zeros(2, 64, dtype=torch.bfloat16)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    assert not ops.apply_token_bitmask(logits, bitmask, [0, 1], 64)
    assert torch.count_nonzero(logits) == 0


def test_a_row_outside_the_tensors_is_refused() -> None:
    logits = torch.zeros(2, 64)
    bitmask = torch.zeros(2, 2, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="outside"):
        ops.apply_token_bitmask(logits, bitmask, [2], 64)
