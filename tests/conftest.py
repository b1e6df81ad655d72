"""Suite-wide set-up: with parallel workers (pytest-xdist, scripts/test.sh), each worker's
torch takes its share of the cores, so two workers on two cores do not oversubscribe them."""

from __future__ import annotations

import os

import pytest


def pytest_configure(config: pytest.Config) -> None:
    num_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if num_workers > 1:
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // num_workers))
