"""Kernel tests run Triton on CPU through its interpreter; the variable must be set before any
module imports triton, hence at the top of the conftest (pytest loads it first)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


from collections.abc import Iterator

import pytest

from tests.kernels.poison import poisoned_allocations


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the test, torch.empty/empty_like return NaN-filled (or poison-int) tensors."""
    with poisoned_allocations(monkeypatch):
        yield
