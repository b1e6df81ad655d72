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


def test_more_threads_measure_at_least_as_much_in_total(extension) -> None:  # type: ignore[no-untyped-def]
    one, two = measure_int8_peak(1), measure_int8_peak(2)
    best_one = max(v for v in one if math.isfinite(v))
    best_two = max(v for v in two if math.isfinite(v))
    # Two threads on two cores add up; on a busy machine they at least do not lose half.
    assert best_two > 0.5 * best_one
