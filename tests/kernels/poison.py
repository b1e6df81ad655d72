"""Fills every tensor the kernel wrappers allocate with garbage, so an element a kernel fails
to write shows up as NaN (floats) or an impossible value (integers) instead of a lucky zero."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

INT_POISON = -(2**30)


def poison_(t: torch.Tensor) -> torch.Tensor:
    if t.is_floating_point():
        return t.fill_(float("nan"))
    if t.dtype == torch.bool:
        return t
    return t.fill_(max(INT_POISON, torch.iinfo(t.dtype).min))


@contextmanager
def poisoned_allocations(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    real_empty, real_empty_like = torch.empty, torch.empty_like

    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison_(real_empty(*args, **kwargs))

    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        return poison_(real_empty_like(*args, **kwargs))

    with monkeypatch.context() as m:
        m.setattr(torch, "empty", empty)
        m.setattr(torch, "empty_like", empty_like)
        yield
