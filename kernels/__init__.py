"""Compute kernels for llmserve: one function per op in `kernels.ops`.

Each op has a torch implementation (the CPU path and the test oracle) and, where it pays, a
Triton kernel with the same signature; `kernels.backend` picks between them in one place.
"""
