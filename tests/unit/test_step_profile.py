"""The step profile's grouping of profiler op names into table rows."""

from __future__ import annotations

import pytest

from benchmarks.step_profile import kind_of


@pytest.mark.parametrize(
    ("op_name", "kind"),
    [
        ("llmserve::gguf_linear", "matmuls"),
        ("aten::addmm", "matmuls"),
        ("aten::_weight_int4pack_mm_for_cpu", "matmuls"),
        ("llmserve::paged_decode_attention", "attention"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("llmserve::write_cache", "KV-cache write"),
        ("aten::index_copy_", "KV-cache write"),
        ("aten::argmax", "sampling"),
        ("graph_0_cpp_fused_add_mean_mul_0", "other ops"),
        ("aten::add", "other ops"),
    ],
)
def test_ops_land_in_their_row(op_name: str, kind: str) -> None:
    assert kind_of(op_name) == kind
