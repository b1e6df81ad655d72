"""Small @triton.jit helpers shared by several kernels."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_half_even(x):
    """Rounds fp32 to the nearest integer, ties to even (torch.round's rule)."""
    rounded = tl.floor(x + 0.5)
    # floor(x + 0.5) rounds ties up; a tie that landed on an odd integer goes down instead.
    is_tie = (rounded - x) == 0.5
    is_odd = (rounded - 2.0 * tl.floor(rounded * 0.5)) != 0.0
    return tl.where(is_tie & is_odd, rounded - 1.0, rounded)
