"""Which build of the C++ kernels a CPU loads (kernels/cpu_extension.py VARIANTS): chosen from
the CPU's flags at run time, never from the machine that built it."""

from __future__ import annotations

import pytest

from kernels import cpu_extension
from kernels.cpu_extension import VARIANTS, best_variant, chosen_variant, library_name

AVX2_MACHINE = {"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"}
AVX512_MACHINE = AVX2_MACHINE | {
    "avx512f",
    "avx512bw",
    "avx512dq",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
}


def test_each_cpu_gets_the_best_variant_it_runs() -> None:
    assert best_variant(AVX512_MACHINE).name == "avx512"
    assert best_variant(AVX2_MACHINE).name == "avx2"
    assert best_variant(AVX2_MACHINE | {"avx_vnni"}).name == "avx2-vnni"
    # AVX-512 VNNI without BF16 (Ice Lake) and without AVX-VNNI: plain AVX2.
    assert best_variant(AVX512_MACHINE - {"avx512_bf16"}).name == "avx2"
    # AVX-512 without VNNI and BF16 (Skylake-X): the AVX2 build, not an illegal instruction.
    assert (
        best_variant(AVX2_MACHINE | {"avx512f", "avx512bw", "avx512dq", "avx512vl"}).name == "avx2"
    )
    assert best_variant({"sse4_2", "avx"}).name == "baseline"
    assert best_variant(set()).name == "baseline"


def test_libraries_are_named_by_variant_and_sources_only() -> None:
    names = {library_name(variant) for variant in VARIANTS}
    assert len(names) == len(VARIANTS)
    assert all(
        name.startswith(f"llmserve_cpu_{v.name.replace('-', '_')}_")
        for name, v in zip([library_name(v) for v in VARIANTS], VARIANTS, strict=True)
    )


def test_the_environment_names_a_variant(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(cpu_extension.VARIANT_ENV_VAR, "baseline")
    assert chosen_variant().name == "baseline"
    monkeypatch.setenv(cpu_extension.VARIANT_ENV_VAR, "avx1024")
    message = "LLMSERVE_CPU_VARIANT must be one of avx512, avx2-vnni, avx2"
    with pytest.raises(ValueError, match=message):
        chosen_variant()
    monkeypatch.delenv(cpu_extension.VARIANT_ENV_VAR)
    assert chosen_variant() == best_variant(cpu_extension.cpu_flags())


def test_a_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A build killed midway leaves torch's lock file, on which every later build would wait
    forever; one younger than a build can take belongs to a build still running."""
    lock = tmp_path / "lock"
    lock.write_text("")
    mtime = lock.stat().st_mtime
    assert not cpu_extension.remove_stale_lock(tmp_path, now=mtime + 60)
    assert lock.exists()
    assert cpu_extension.remove_stale_lock(tmp_path, now=mtime + cpu_extension.STALE_LOCK_S + 1)
    assert not lock.exists()
    assert not cpu_extension.remove_stale_lock(tmp_path)  # nothing to remove


def test_build_kernels_names_the_variant_it_loaded(capsys) -> None:  # type: ignore[no-untyped-def]
    import argparse

    from services.build_kernels_command import run

    assert run(argparse.Namespace(all=False)) == 0
    out = capsys.readouterr().out
    assert f"variant {best_variant(cpu_extension.cpu_flags()).name}" in out
    assert cpu_extension.loaded_variant() == best_variant(cpu_extension.cpu_flags()).name
