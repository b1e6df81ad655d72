"""Greedy sampling's argmax (kernels/csrc/argmax_rows.cpp) gives torch.argmax(dim=-1)'s ids on
fresh random logits with ties, NaNs and infinities, through the op and through kernels.ops
(which keeps torch's own argmax where the kernel does not apply)."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_extension, ops
from tests.kernels.cpu_extension_cases import check_argmax_rows, seeded

pytestmark = pytest.mark.skipif(
    not cpu_extension.load(), reason="the C++ CPU kernels do not build here"
)


def test_the_kernel_matches_torch_argmax() -> None:
    assert check_argmax_rows(torch.ops.llmserve, seeded("main", "argmax rows")) == 6


@pytest.mark.parametrize("rows", [1, 3, 32])
def test_ops_argmax_rows_matches_torch_on_fresh_logits(rows: int) -> None:
    logits = torch.randn(rows, 49152)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_and_strided_rows_take_torch_argmax(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 1000).to(dtype)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    columns = torch.randn(1000, 4).t()  # stride(1) != 1
    assert torch.equal(ops.argmax_rows(columns), columns.argmax(dim=-1))


def test_a_row_without_values_is_refused() -> None:
    with pytest.raises(RuntimeError, match="no values"):
        torch.ops.llmserve.argmax_rows(torch.empty(2, 0))
