"""The int8 peak probe (kernels/csrc/int8_peak.cpp) that the benchmarks hold the GEMM kernels
against: one figure per instruction form, positive where this build has the form."""

from __future__ import annotations

import math

import torch

from benchmarks.machine_peaks import MEASURED_FORMS, measure_int8_peak
from kernels import cpu_extension


def test_every_form_the_build_has_is_measured(extension) -> None:  # type: ignore[no-untyped-def]
    figures = torch.ops.llmserve.int8_dot_peak(10_000)
    assert len(figures) == len(MEASURED_FORMS)
    variant = cpu_extension.chosen_variant().name
    # Every x86-64-v3 build and up has the AVX2 pair form; NaN marks a form the build lacks.
    assert (figures[2] > 0) == (variant != "baseline"), (variant, figures)
    assert (figures[0] > 0) == (variant in ("avx512", "avx2-vnni")), (variant, figures)
    assert (figures[1] > 0) == (variant == "avx512"), (variant, figures)
    for value in figures:
        assert math.isnan(value) or value > 0


def test_the_machine_peak_reads_each_form_in_the_ops_order(extension) -> None:  # type: ignore[no-untyped-def]
    """measure_int8_peak keeps one figure per form, where the build has it (a function check:
    no speed is asserted)."""
    figures = measure_int8_peak(1)
    raw = torch.ops.llmserve.int8_dot_peak(1_000)
    assert len(figures) == len(MEASURED_FORMS) == len(raw)
    for best, probe in zip(figures, raw, strict=True):
        assert math.isnan(best) == math.isnan(probe)
        assert math.isnan(best) or best > 0
