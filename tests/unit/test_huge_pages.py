"""The huge-page arena: aligned, disjoint slices that outlive the arena object, read as zeros
until written, on a mapping the kernel was asked to back with huge pages."""

from __future__ import annotations

import gc
import itertools
import re
from pathlib import Path

import pytest
import torch

from services.worker.huge_pages import ALIGNMENT, HUGE_PAGE, HugePageArena, huge_page_buffer

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    current: tuple[int, int] | None = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        bounds = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if bounds:
            current = (int(bounds[1], 16), int(bounds[2], 16))
        elif line.startswith("VmFlags:") and current and current[0] <= address < current[1]:
            return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_slices_are_aligned_disjoint_and_in_order() -> None:
    arena = HugePageArena(10 * HUGE_PAGE)
    sizes = [1, 1000, 3 * HUGE_PAGE + 7, 63, 4096]
    slices = [arena.take(size) for size in sizes]
    assert [s.numel() for s in slices] == sizes
    assert slices[0].data_ptr() % HUGE_PAGE == 0  # the first slice starts on a huge page
    for before, after in itertools.pairwise(slices):
        assert after.data_ptr() % ALIGNMENT == 0
        assert after.data_ptr() >= before.data_ptr() + before.numel()
    for number, piece in enumerate(slices):
        piece.fill_(number + 1)
    assert [int(s.min()) for s in slices] == [int(s.max()) for s in slices] == [1, 2, 3, 4, 5]


def test_fresh_slices_read_as_zeros_and_outlive_the_arena() -> None:
    arena = HugePageArena(4 * HUGE_PAGE)
    piece = arena.take(3 * HUGE_PAGE)
    assert int(piece.count_nonzero()) == 0
    del arena
    gc.collect()
    piece.view(torch.float32).fill_(2.5)
    assert float(piece.view(torch.float32).sum()) == 2.5 * 3 * HUGE_PAGE / 4


def test_a_slice_past_the_capacity_is_refused() -> None:
    arena = HugePageArena(1000)
    arena.take(900)
    with pytest.raises(ValueError, match="does not fit"):
        arena.take(101)
    with pytest.raises(ValueError, match="capacity"):
        HugePageArena(0)


def test_the_mapping_asks_for_huge_pages_where_the_kernel_offers_them() -> None:
    arena = HugePageArena(8 * HUGE_PAGE)
    piece = arena.take(8 * HUGE_PAGE)
    piece.fill_(1)
    # "hg": the range carries MADV_HUGEPAGE, so "madvise" mode backs it with huge pages. A
    # kernel built with transparent huge pages has the sysfs file and takes the advice.
    assert arena.huge == THP_MODE.exists()
    assert ("hg" in _vm_flags(piece.data_ptr())) == arena.huge


def test_a_buffer_is_a_whole_arena() -> None:
    buffer = huge_page_buffer(12345)
    assert buffer.dtype == torch.uint8 and buffer.numel() == 12345
    assert buffer.data_ptr() % HUGE_PAGE == 0
    assert huge_page_buffer(0).numel() == 0  # an empty tensor's storage
