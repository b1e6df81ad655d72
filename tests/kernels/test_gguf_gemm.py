"""The GGUF block kernels (kernels/csrc/gguf_gemm.cpp: the main build, a forced-scalar build
and one running the VNNI code path on AVX2) against the torch reference in fp64, on fresh
random blocks: every kind (Q4_0/Q4_1/Q8_0 decoded in torch, the others by the gguf package's
numpy decoders, llama.cpp's reference), negative and zero scales.

Tolerances, per output element, with B = |x| @ |W|^T (the sum of the magnitudes):
- fp32 (exact weights, fp32 sums): 1e-6 B. Measured below 1e-7 B: only summation order
  differs from the fp64 product.
- bf16/fp16 (int8 activation blocks): the activation rounding, at most s_j / 2 per value
  (s = block amax / 127), so |y - y_exact| <= sum_j |W_nj| s_j / 2 + the output rounding
  (2^-8 relative for bf16, 2^-11 for fp16) + 1e-5 B. Against the reference fed the same
  rounded activations only the output rounding and 1e-5 B remain. Q4 weights with at least
  HALF_PANEL_MIN_ROWS activation rows are computed in fp32 on exact weights instead: there
  the unrounded activations leave only the output rounding and 1e-5 B.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from kernels import cpu_extension, gguf_blocks_torch, ops
from kernels.gguf_blocks_torch import (
    BLOCK_VALUES,
    GGUF_KINDS,
    GGUF_Q4_0,
    GGUF_Q4_1,
    GGUF_Q8_0,
    GGUF_REPACKED_X8,
    HALF_PANEL_MIN_ROWS,
    KIND_NAMES,
    REPACKABLE_KINDS,
    SCALE_OFFSETS,
    activation_block,
    dequantize_blocks,
    group_shape,
    quantize_activation_blocks,
)
from services.common.cache_files import locked

KINDS = list(GGUF_KINDS.values())
KIND_IDS = list(GGUF_KINDS)
EXACT_RTOL = 1e-6
SUM_RTOL = 1e-5
OUTPUT_ROUNDING = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-24}
# (K, N) in blocks of the kind: a single block, N not a multiple of the 4-row register tile,
# and two model shapes (SmolLM2's q|k|v and down for 32-value kinds).
SHAPE_BLOCKS = {32: [(1, 5), (3, 37), (18, 960), (48, 64)], 256: [(1, 5), (3, 37), (6, 64)]}


def shapes_of(kind: int) -> list[tuple[int, int]]:
    values = group_shape(kind)[0]
    return [(blocks * values, n) for blocks, n in SHAPE_BLOCKS[values]]


CASES = [
    pytest.param(kind, k, n, id=f"{name}-{k}x{n}")
    for kind, name in zip(KINDS, KIND_IDS, strict=True)
    for k, n in shapes_of(kind)
]


@pytest.fixture(scope="module")
def extension():  # type: ignore[no-untyped-def]
    assert cpu_extension.load(), "the C++ kernels must build on this machine (gcc, ninja)"
    return torch.ops.llmserve


# variant -> (compiler flags, the ISA its ops must report)
VARIANTS = {
    "scalar": (["-DLLMSERVE_GGUF_SCALAR"], "scalar"),
    # The VNNI code in 4-row tiles (AVX-VNNI CPUs' build), whatever this CPU has.
    "vnni-emulated": (
        ["-march=x86-64-v3", "-mno-avxvnni", "-DLLMSERVE_GGUF_EMULATE_VNNI"],
        "avx2+vnni-emulated",
    ),
    # The vpmaddubsw path of AVX2 CPUs without VNNI, which a VNNI machine's own build skips.
    "avx2-no-vnni": (["-march=x86-64-v3", "-mno-avxvnni"], "avx2"),
    # The vpmaddubsw path in 8-row and 16-row tiles: AVX-512 CPUs without VNNI (Skylake-X).
    "avx512-no-vnni": (
        ["-march=x86-64-v4", "-mno-avx512vnni", "-mno-avxvnni", "-mtune=generic"],
        "avx512",
    ),
}


def build_variant(variant: str):  # type: ignore[no-untyped-def]
    """gguf_gemm.cpp alone with other flags, its ops under their own namespace (so the build
    loads beside the main library): the scalar fallback, and the VNNI path on AVX2."""
    from torch.utils.cpp_extension import load

    flags, isa = VARIANTS[variant]
    source = cpu_extension.SOURCE_DIR / "gguf_gemm.cpp"
    namespace = f"llmserve_gguf_{variant.replace('-', '_')}"
    # The checkout's path too: one build per checkout, as the product's library.
    # Its headers too: torch's own check hashes only the listed source.
    headers = sorted(cpu_extension.SOURCE_DIR.glob("*.h"))
    digest = hashlib.sha1(
        b"".join(path.read_bytes() for path in [source, *headers])
        + " ".join(flags).encode()
        + str(source.resolve()).encode()
    ).hexdigest()
    name = f"{namespace}_{digest[:10]}"
    # In llmserve's cache (LLMSERVE_CACHE_DIR), as the product's libraries, so a run from an
    # empty cache builds it too; under a lock, so parallel test workers build it once.
    directory = cpu_extension.build_directory(name)
    with locked(directory / f"{name}.so"):
        _load_variant(load, name, source, directory, namespace, flags)
    ops_namespace = getattr(torch.ops, namespace)
    assert ops_namespace.gguf_kernel_isa() == isa
    return ops_namespace


def _load_variant(load, name, source, directory, namespace, flags) -> None:  # type: ignore[no-untyped-def]
    load(
        name=name,
        build_directory=str(directory),
        sources=[str(source)],
        extra_cflags=[
            "-O2",
            "-fopenmp",
            "-fno-strict-aliasing",
            f"-DLLMSERVE_GGUF_NAMESPACE={namespace}",
            *flags,
        ],
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
    )


@pytest.fixture(scope="module")
def scalar_extension():  # type: ignore[no-untyped-def]
    return build_variant("scalar")


@pytest.fixture(scope="module")
def vnni_emulated_extension(extension):  # type: ignore[no-untyped-def]
    if not extension.gguf_kernel_isa().startswith("avx"):
        pytest.skip("the VNNI path is AVX2 code")
    return build_variant("vnni-emulated")


@pytest.fixture(scope="module")
def avx2_extension(extension):  # type: ignore[no-untyped-def]
    if not extension.gguf_kernel_isa().startswith("avx"):
        pytest.skip("the CPU has no AVX2")
    return build_variant("avx2-no-vnni")


@pytest.fixture(scope="module")
def avx512_no_vnni_extension(extension):  # type: ignore[no-untyped-def]
    if "avx512vl" not in cpu_extension.cpu_flags_line().split():
        pytest.skip("the CPU has no AVX-512VL: the 8-row tiles cannot run here")
    return build_variant("avx512-no-vnni")


BUILDS = {
    "simd": "extension",
    "scalar": "scalar_extension",
    "vnni-emulated": "vnni_emulated_extension",
    "avx2": "avx2_extension",
    "avx512-no-vnni": "avx512_no_vnni_extension",
}


@pytest.fixture(params=list(BUILDS))
def linear_op(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(BUILDS[request.param]).gguf_linear


@pytest.fixture(params=["simd", "scalar"])  # fp32 never reaches the VNNI code
def exact_linear_op(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(BUILDS[request.param]).gguf_linear


def random_blocks(n: int, k: int, kind: int, seed: int) -> torch.Tensor:
    """Random codes and sub-block scales with finite fp16 scales of both signs, some exactly
    zero."""
    g = torch.Generator().manual_seed(seed)
    values, size = group_shape(kind)
    num_blocks = k // values
    raw = torch.randint(0, 256, (n, num_blocks, size), dtype=torch.uint8, generator=g)
    for index, offset in enumerate(SCALE_OFFSETS[kind]):
        scale = 0.02 if index == 0 else 0.1
        d = torch.randn(n, num_blocks, 1, generator=g) * scale
        d[torch.rand(n, num_blocks, 1, generator=g) < 0.05] = 0.0
        raw[..., offset : offset + 2] = d.half().view(torch.uint8)
    if kind == GGUF_Q8_0:
        raw[0, 0, 2] = 0x80  # -128: the one code whose magnitude does not fit int8
    return raw.view(n, num_blocks * size)


def activations(m: int, k: int, seed: int) -> torch.Tensor:
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed))
    x[0, :BLOCK_VALUES] = 0.0  # an all-zero block: scale 0
    return x


def test_reference_decodes_like_the_gguf_package() -> None:
    quants = pytest.importorskip("gguf.quants")
    from gguf import GGMLQuantizationType

    for kind, name in zip(KINDS, KIND_IDS, strict=True):
        blocks = random_blocks(7, 3 * group_shape(kind)[0], kind, seed=kind)
        theirs = quants.dequantize(blocks.numpy(), GGMLQuantizationType[name])
        torch.testing.assert_close(
            dequantize_blocks(blocks, kind), torch.from_numpy(theirs), atol=0, rtol=0
        )


@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize(("kind", "k", "n"), CASES)
def test_fp32_is_exact_up_to_summation_order(  # type: ignore[no-untyped-def]
    exact_linear_op, kind: int, m: int, k: int, n: int
) -> None:
    blocks = random_blocks(n, k, kind, seed=k + n + kind)
    x = activations(m, k, seed=m)
    weight = dequantize_blocks(blocks, kind).double()
    expected = x.double() @ weight.t()
    magnitude = x.double().abs() @ weight.abs().t()
    got = exact_linear_op(x, blocks, kind)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    excess = (got.double() - expected).abs() - EXACT_RTOL * magnitude
    assert excess.max() <= 1e-30, f"worst excess {excess.max().item():.3g}"


@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32-int8"]
)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
@pytest.mark.parametrize(("kind", "k", "n"), CASES)
def test_fast_path_within_its_rounding_bound(  # type: ignore[no-untyped-def]
    linear_op, dtype: torch.dtype, kind: int, m: int, k: int, n: int
) -> None:
    """bf16/fp16 activations, and fp32 ones with int8_activations (the gguf format)."""
    blocks = random_blocks(n, k, kind, seed=k + n + kind)
    x = activations(m, k, seed=m).to(dtype)
    weight = dequantize_blocks(blocks, kind).double()
    got = linear_op(x, blocks, kind, dtype == torch.float32)
    assert got.dtype == dtype and got.shape == (m, n)
    got = got.double()

    # 1. The kernel's arithmetic: the reference fed the same activations (int8 blocks, or
    # the bf16/fp16 values themselves on the fp32 panel path).
    int8_blocks = kind not in (GGUF_Q4_0, GGUF_Q4_1) or m < HALF_PANEL_MIN_ROWS
    block = activation_block(kind)  # 256 for the K-quants (llama.cpp's Q8_K), else 32
    rounded = (quantize_activation_blocks(x, block) if int8_blocks else x.float()).double()
    same_input = rounded @ weight.t()
    bound = OUTPUT_ROUNDING[dtype] * same_input.abs() + SUM_RTOL * (
        rounded.abs() @ weight.abs().t()
    )
    assert ((got - same_input).abs() - bound).max() <= 1e-30

    # 2. The stated tolerance against the exact product: the activation rounding bound.
    x64 = x.double()
    exact = x64 @ weight.t()
    scale = x64.view(m, -1, block).abs().amax(dim=-1) / 127
    half_step = scale.repeat_interleave(block, dim=1) / 2
    bound = (
        half_step @ weight.abs().t()
        + OUTPUT_ROUNDING[dtype] * exact.abs()
        + SUM_RTOL * (x64.abs() @ weight.abs().t())
    )
    assert ((got - exact).abs() - bound).max() <= 1e-30


@pytest.mark.parametrize("kind", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_embedding_rows_are_exact(extension, kind: int, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    blocks = random_blocks(50, 2 * group_shape(kind)[0], kind, seed=kind)
    for ids in (torch.tensor([[0, 49, 7], [7, 3, 0]]), torch.tensor([5, 1], dtype=torch.int32)):
        got = extension.gguf_embedding(ids, blocks, kind, dtype)
        rows = dequantize_blocks(blocks, kind)[ids.long()].to(dtype)
        assert got.dtype == dtype and torch.equal(got, rows)
        assert torch.equal(gguf_blocks_torch.gguf_embedding(ids, blocks, kind, dtype), rows)
    with pytest.raises(RuntimeError, match="outside the table"):
        extension.gguf_embedding(torch.tensor([50]), blocks, kind, dtype)


def test_bad_shapes_raise_clear_errors(extension) -> None:  # type: ignore[no-untyped-def]
    blocks = random_blocks(4, 64, GGUF_Q4_1, seed=0)
    with pytest.raises(RuntimeError, match="not a multiple of 32"):
        extension.gguf_linear(torch.zeros(1, 48), blocks, GGUF_Q4_1)
    with pytest.raises(RuntimeError, match="x has K = 96"):
        extension.gguf_linear(torch.zeros(1, 96), blocks, GGUF_Q4_1)
    with pytest.raises(RuntimeError, match="kind must be"):
        extension.gguf_linear(torch.zeros(1, 64), blocks, 16)
    with pytest.raises(RuntimeError, match="whole number"):
        extension.gguf_linear(torch.zeros(1, 64), blocks, GGUF_Q8_0)


def test_ops_dispatch_to_the_extension_or_the_reference(
    extension,  # type: ignore[no-untyped-def]
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from kernels import backend

    blocks = random_blocks(9, 64, GGUF_Q4_0, seed=1)
    x = activations(2, 64, seed=2)
    monkeypatch.delenv(backend.BACKEND_ENV_VAR, raising=False)
    native = ops.gguf_linear(x, blocks, GGUF_Q4_0)
    torch.testing.assert_close(native, extension.gguf_linear(x, blocks, GGUF_Q4_0))
    monkeypatch.setenv(backend.BACKEND_ENV_VAR, "torch")
    reference = ops.gguf_linear(x, blocks, GGUF_Q4_0)
    assert torch.equal(reference, gguf_blocks_torch.gguf_linear(x, blocks, GGUF_Q4_0))
    torch.testing.assert_close(native, reference, atol=1e-5, rtol=1e-5)


def test_layers_run_inside_a_full_compiled_graph(extension) -> None:  # type: ignore[no-untyped-def]
    from services.worker.quantization.gguf_linear import GGUFEmbedding, GGUFLinear

    table = GGUFEmbedding(random_blocks(100, 64, GGUF_Q8_0, seed=3), GGUF_Q8_0, torch.float32)
    head = GGUFLinear(table.blocks, GGUF_Q8_0, None)
    proj = GGUFLinear(random_blocks(64, 64, GGUF_Q4_1, seed=4), GGUF_Q4_1, torch.ones(64))

    def step(token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = proj(table(token_ids))
        return head(hidden), head(hidden.to(torch.bfloat16))

    compiled = torch.compile(step, fullgraph=True, dynamic=True)
    torch._dynamo.reset()
    for count in (3, 5):  # two token counts: one graph with a symbolic M
        token_ids = torch.arange(count) * 7
        for got, expected in zip(compiled(token_ids), step(token_ids), strict=True):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["exact", "int8"])
@pytest.mark.parametrize("m", [1, 5, 20])
def test_parts_of_different_kinds_equal_their_own_products(  # type: ignore[no-untyped-def]
    linear_op, m: int, int8_activations: bool
) -> None:
    """A fused layer stored as Q5_0 | Q8_0 | Q6_K | Q4_0 parts (a Q4_K_M file's q|k|v, say):
    the parts' outputs side by side, each as its own call computes it (the activations are
    rounded once, the same way for every part)."""
    namespace = linear_op._qualified_op_name.split("::")[0]  # the build under test
    parts_op = getattr(torch.ops, namespace).gguf_linear_parts
    kinds = [GGUF_KINDS[name] for name in ("Q5_0", "Q8_0", "Q6_K", "Q4_0")]
    rows = (7, 16, 3, 9)
    parts = [random_blocks(n, 512, kind, seed=n) for n, kind in zip(rows, kinds, strict=True)]
    x = activations(m, 512, seed=m)
    got = parts_op(x, parts, kinds, int8_activations)
    alone = [
        linear_op(x, part, kind, int8_activations) for part, kind in zip(parts, kinds, strict=False)
    ]
    expected = torch.cat(alone, dim=1)
    assert got.shape == (m, 35) and torch.equal(got, expected)
    with pytest.raises(RuntimeError, match="one kind per part"):
        parts_op(x, parts, kinds[:2], int8_activations)


REPACKED_CASES = [
    pytest.param(kind, k, n, id=f"{KIND_NAMES[kind]}-{k}x{n}")
    for kind in REPACKABLE_KINDS
    for k, n in (
        [(256, 8), (1536, 64), (2048, 40)]
        if group_shape(kind)[0] == 256
        else [(32, 8), (576, 64), (1536, 40)]
    )
]


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 9, 40])
@pytest.mark.parametrize(("kind", "k", "n"), REPACKED_CASES)
def test_blocks_repacked_by_8_rows_give_the_file_layouts_int8_products(  # type: ignore[no-untyped-def]
    linear_op, kind: int, m: int, k: int, n: int
) -> None:
    """The x8 layout holds the same bytes (a permutation of them) and its kernel computes the
    int8-activation products of the file layout's kernel: the same integer dots and scales,
    so equal up to fp32 summation order, at every M (the file layout switches Q4 to fp32
    panels from 16 rows; there the x8 kernel is held to the int8 reference instead)."""
    namespace = linear_op._qualified_op_name.split("::")[0]
    ops_namespace = getattr(torch.ops, namespace)
    blocks = random_blocks(n, k, kind, seed=n + k)
    repacked = ops_namespace.gguf_repack(blocks, kind)
    assert repacked.shape == blocks.shape
    assert torch.equal(repacked.flatten().sort().values, blocks.flatten().sort().values)
    x = activations(m, k, seed=m)
    got = linear_op(x, repacked, kind | GGUF_REPACKED_X8, True).double()
    weight = dequantize_blocks(blocks, kind).double()
    rounded = quantize_activation_blocks(x, activation_block(kind)).double()
    same_input = rounded @ weight.t()
    bound = 1e-5 * (rounded.abs() @ weight.abs().t()) + 1e-6
    assert ((got - same_input).abs() - bound).max() <= 0
    if m < HALF_PANEL_MIN_ROWS:
        file_layout = linear_op(x, blocks, kind, True).double()
        assert ((got - file_layout).abs() - bound).max() <= 0
    ids = torch.tensor([0, n - 1, n // 2])
    assert torch.equal(
        ops_namespace.gguf_embedding(ids, repacked, kind | GGUF_REPACKED_X8, torch.float32),
        dequantize_blocks(blocks, kind)[ids],
    )


def test_repacked_blocks_refuse_the_exact_path(extension) -> None:  # type: ignore[no-untyped-def]
    blocks = extension.gguf_repack(random_blocks(8, 64, GGUF_Q4_0, seed=0), GGUF_Q4_0)
    with pytest.raises(RuntimeError, match="int8 activations"):
        extension.gguf_linear(torch.zeros(1, 64), blocks, GGUF_Q4_0 | GGUF_REPACKED_X8)
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        extension.gguf_repack(random_blocks(12, 64, GGUF_Q4_0, seed=0), GGUF_Q4_0)


def test_kernel_layout_repacks_what_it_can(extension) -> None:  # type: ignore[no-untyped-def]
    q4 = random_blocks(16, 64, GGUF_Q4_1, seed=0)
    blocks, kind = ops.gguf_kernel_layout(q4, GGUF_Q4_1)
    assert kind == GGUF_Q4_1 | GGUF_REPACKED_X8 and not torch.equal(blocks, q4)
    odd = random_blocks(12, 64, GGUF_Q4_1, seed=0)
    assert ops.gguf_kernel_layout(odd, GGUF_Q4_1) == (odd, GGUF_Q4_1)
    k_quant = random_blocks(16, 256, GGUF_KINDS["Q4_K"], seed=0)
    assert ops.gguf_kernel_layout(k_quant, GGUF_KINDS["Q4_K"])[1] == (
        GGUF_KINDS["Q4_K"] | GGUF_REPACKED_X8
    )
    iq4 = random_blocks(16, 256, GGUF_KINDS["IQ4_XS"], seed=0)
    assert ops.gguf_kernel_layout(iq4, GGUF_KINDS["IQ4_XS"]) == (iq4, GGUF_KINDS["IQ4_XS"])


@pytest.mark.parametrize("kind", REPACKABLE_KINDS, ids=[KIND_NAMES[k] for k in REPACKABLE_KINDS])
def test_repacking_in_place_gives_the_copys_bytes(extension, kind: int) -> None:  # type: ignore[no-untyped-def]
    blocks = random_blocks(24, 512, kind, seed=kind)
    copied = extension.gguf_repack(blocks, kind)
    in_place, laid_kind = ops.gguf_kernel_layout(blocks.clone(), kind, in_place=True)
    assert laid_kind == kind | GGUF_REPACKED_X8 and torch.equal(in_place, copied)
    assert not torch.equal(copied, blocks)


@pytest.mark.parametrize("kind", [GGUF_Q4_0, GGUF_KINDS["Q4_K"], GGUF_KINDS["Q6_K"]])
def test_x8_rows_are_the_same_in_any_batch_past_the_activation_block(  # type: ignore[no-untyped-def]
    linear_op, kind: int
) -> None:
    """150 rows of K = 8192 pass the kernels' activation block (512 KiB of int8 codes: 64
    rows here), so the weights stream past in three passes; every row is still bit-identical
    to the same row computed alone."""
    namespace = linear_op._qualified_op_name.split("::")[0]
    ops_namespace = getattr(torch.ops, namespace)
    k, n, m = 8192, 16, 150
    repacked = ops_namespace.gguf_repack(random_blocks(n, k, kind, seed=3), kind)
    x = activations(m, k, seed=4)
    together = linear_op(x, repacked, kind | GGUF_REPACKED_X8, True)
    for row in (0, 63, 64, 127, 128, 149):
        alone = linear_op(x[row : row + 1], repacked, kind | GGUF_REPACKED_X8, True)
        assert torch.equal(together[row : row + 1], alone), row


def test_repacking_in_place_refuses_what_it_cannot_regroup(extension) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        extension.gguf_repack_(random_blocks(12, 256, GGUF_KINDS["Q4_K"], seed=0), 12)
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        extension.gguf_repack_(random_blocks(16, 256, GGUF_KINDS["IQ4_XS"], seed=0), 23)
    strided = random_blocks(16, 512, GGUF_Q4_0, seed=0)[:, : 8 * 18]
    with pytest.raises(RuntimeError, match="contiguous"):
        extension.gguf_repack_(strided, GGUF_Q4_0)


def identity_blocks(k: int, kind: int) -> torch.Tensor:
    """W = I [k, k] as blocks of `kind` (Q8_0, or Q6_K with every sub-block scale 1 and the
    codes at the zero point 32 but one): each output is one activation code times its scale,
    so a product is the rounded activation itself, exactly."""
    values, size = group_shape(kind)
    raw = torch.zeros(k, k // values, size, dtype=torch.uint8)
    rows = torch.arange(k)
    one = torch.tensor([1.0]).half().view(torch.uint8)
    if kind == GGUF_Q8_0:
        raw[..., 0:2] = one
        raw[rows, rows // values, 2 + rows % values] = 1
    else:  # Q6_K: ql[128] | qh[64] | scales[16] | d
        raw[..., 128:192] = 0xAA  # the two high bits of every code: 2, so 32 with ql = 0
        raw[..., 192:208] = 1
        raw[..., 208:210] = one
        position = rows % values
        half, quarter, lane = position // 128, position % 128 // 32, position % 32
        ql = half * 64 + lane + 32 * (quarter % 2)
        raw[rows, rows // values, ql] = torch.where(quarter < 2, 1, 0x10).to(torch.uint8)
    return raw.view(k, k // values * size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [GGUF_Q8_0, GGUF_KINDS["Q6_K"]], ids=["Q8_0", "Q6_K"])
def test_activation_codes_are_the_torch_rounding_exactly(  # type: ignore[no-untyped-def]
    linear_op, kind: int, dtype: torch.dtype
) -> None:
    """The int8 rounding of activations (kernels/csrc/activation_codes.h: SIMD where the build
    has it) gives quantize_activation_blocks' codes and scales bit for bit: an all-zero
    block, ties to even, both signs, bf16 inputs."""
    namespace = linear_op._qualified_op_name.split("::")[0]
    ops_namespace = getattr(torch.ops, namespace)
    block = activation_block(kind)
    k = 2 * block if block == 256 else 3 * block
    blocks = identity_blocks(k, kind)
    assert torch.equal(dequantize_blocks(blocks, kind), torch.eye(k))
    x = activations(5, k, seed=kind)
    # amax 127: scale 1, so the halves are ties (2.5 -> 2, -3.5 -> -4, 0.5 -> 0).
    x[1, block : 2 * block] = torch.tensor([127.0, 2.5, -3.5, 0.5, -0.5] * (block // 5 + 1))[:block]
    x = x.to(dtype)
    expected = quantize_activation_blocks(x, block)
    layouts = [(ops_namespace.gguf_repack(blocks, kind), kind | GGUF_REPACKED_X8)]
    if kind == GGUF_Q8_0:
        # A K-quant's file-layout kernel rounds d times the sub-block scale apart from the
        # activation scale (a second rounding of the same codes); Q8_0's has one, as x8's.
        layouts.append((blocks, kind))
    for weights, laid_kind in layouts:
        for m in (1, 5):
            got = linear_op(x[:m].contiguous(), weights, laid_kind, True)
            assert torch.equal(got.float(), expected[:m].to(dtype).float()), (laid_kind, m)
