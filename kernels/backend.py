"""Chooses the implementation (torch or Triton) of every op in `kernels.ops`, in one place.

Rule: CUDA tensors go to Triton, everything else to torch. The environment variable
`LLMSERVE_KERNEL_BACKEND=torch|triton` overrides the rule; `triton` on CPU tensors only works
under `TRITON_INTERPRET=1` (the kernel tests use it that way).
"""

from __future__ import annotations

import os
from typing import Literal

import torch

Backend = Literal["torch", "triton"]

BACKEND_ENV_VAR = "LLMSERVE_KERNEL_BACKEND"
_VALID_BACKENDS: tuple[Backend, ...] = ("torch", "triton")


def forced_backend() -> Backend | None:
    """The backend named by the environment variable, or None when it is unset or empty."""
    value = os.environ.get(BACKEND_ENV_VAR, "").strip().lower()
    if not value:
        return None
    if value not in _VALID_BACKENDS:
        raise ValueError(f"{BACKEND_ENV_VAR}={value!r}: expected one of {_VALID_BACKENDS}")
    return value  # type: ignore[return-value]


def backend_for(tensor: torch.Tensor) -> Backend:
    """The backend an op should use for inputs living where `tensor` lives."""
    forced = forced_backend()
    if forced is not None:
        return forced
    return "triton" if tensor.is_cuda else "torch"


def use_triton(tensor: torch.Tensor) -> bool:
    return backend_for(tensor) == "triton"


def use_cpu_extension(tensor: torch.Tensor) -> bool:
    """CPU tensors take the C++ kernels (kernels/csrc) where one exists and it builds here;
    LLMSERVE_KERNEL_BACKEND=torch forces the torch reference."""
    if tensor.device.type != "cpu" or forced_backend() is not None:
        return False
    from kernels import cpu_extension

    return cpu_extension.load()
