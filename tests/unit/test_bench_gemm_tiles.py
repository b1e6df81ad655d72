"""`llmserve bench gemm-tiles`'s pure parts: its weights decode to finite values of every
kind it measures, and a kind without an 8-row layout is refused by name."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import gemm_tiles
from kernels.gguf_blocks_torch import REPACKABLE_KINDS, dequantize_blocks


@pytest.mark.parametrize("kind", REPACKABLE_KINDS)
def test_random_blocks_decode_to_finite_weights(kind: int) -> None:
    blocks = gemm_tiles.random_blocks(8, 256, kind)
    weights = dequantize_blocks(blocks, kind)
    assert weights.shape == (8, 256) and torch.isfinite(weights).all()
    assert weights.abs().max() > 0


def test_a_kind_without_the_layout_is_refused() -> None:
    parser = argparse.ArgumentParser()
    gemm_tiles.configure_parser(parser)
    args = parser.parse_args(["--kinds", "Q4_K,IQ4_XS,Q9_Z", "--m", "1"])
    with pytest.raises(SystemExit, match="IQ4_XS, Q9_Z"):
        gemm_tiles.run(args)
