"""Kernel tests run Triton on CPU through its interpreter; the variable must be set before any
module imports triton, hence at the top of the conftest (pytest loads it first)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")


from collections.abc import Iterator

import pytest
import torch

from kernels import cpu_extension
from tests.kernels.poison import poisoned_allocations


@pytest.fixture
def poisoned(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Within the test, torch.empty/empty_like return NaN-filled (or poison-int) tensors."""
    with poisoned_allocations(monkeypatch):
        yield


# ---- the C++ CPU kernels (test_cpu_*.py) ---------------------------------------------------


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


@pytest.fixture
def two_threads() -> Iterator[None]:
    """Long contexts split across threads only when there is more than one."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
