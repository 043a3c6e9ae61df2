"""The C++ CPU kernels' variants and loader (`kernels.isa`, `kernels.cpu_build`): which variant a CPU runs, a build
that a killed build's lock cannot hang, a wait that gives up, a prebuilt module taken only when it matches."""

from __future__ import annotations

import fcntl
import sys

import pytest
import torch
from kvrelay.kernels import cpu_build
from kvrelay.kernels.isa import (
    ISA_ENV,
    VARIANT_BY_NAME,
    build_id,
    build_names,
    cpu_flags,
    module_name,
    runnable,
    variant_for,
)

ZEN4 = frozenset("fpu sse2 avx f16c fma bmi1 bmi2 popcnt avx2 avx512f avx512dq avx512cd avx512bw avx512vl avx512_bf16 "
                 "avx512_vnni".split())
SKYLAKE_SP = ZEN4 - {"avx512_bf16", "avx512_vnni"}
ZEN1 = frozenset("fpu sse2 avx f16c fma bmi1 bmi2 popcnt avx2".split())


def test_each_cpu_gets_the_best_variant_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert [variant_for(f).name for f in (ZEN4, SKYLAKE_SP, ZEN1, ZEN1 - {"fma"}, frozenset())] == [
        "avx512bf16", "avx512", "avx2", "base", "base"]
    assert variant_for(cpu_flags()).needs <= cpu_flags()  # this machine's: one it can run
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert variant_for(ZEN4).name == "avx2"
    monkeypatch.setenv(ISA_ENV, "amx")
    with pytest.raises(ValueError, match="KVRELAY_CPU_ISA='amx': use one of avx512bf16, avx512, avx2, base"):
        variant_for(ZEN4)


def test_an_install_builds_this_machine_s_variant_unless_told_otherwise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert build_names("", ZEN4, "x86_64") == ["avx512bf16"]
    assert build_names("native", ZEN1, "x86_64") == ["avx2"]
    assert build_names(" all ", ZEN1, "x86_64") == ["avx512bf16", "avx512", "avx2", "base"]
    assert build_names("base,native,avx2", ZEN1, "x86_64") == ["base", "avx2"]  # once each, in the order asked
    assert build_names("none", ZEN4, "x86_64") == []
    assert build_names("all", frozenset(), "aarch64") == ["base"]
    with pytest.raises(ValueError, match="KVRELAY_BUILD_VARIANTS: unknown variant 'amx'; use avx512bf16, avx512, "
                                         "avx2, base, native, all or none"):
        build_names("native,amx", ZEN4, "x86_64")


def test_a_cpu_runs_the_variants_at_or_below_its_best(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ISA_ENV, raising=False)
    assert [v.name for v in runnable(SKYLAKE_SP)] == ["avx512", "avx2", "base"]
    assert [v.name for v in runnable(frozenset())] == ["base"]
    monkeypatch.setenv(ISA_ENV, "avx2")
    assert [v.name for v in runnable(ZEN4)] == ["avx2"]  # forced: that one only


def test_without_its_best_variant_prebuilt_a_cpu_takes_the_best_one_that_was(
        base_kernels, monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A wheel built for another CPU: this one (AVX2) finds only the base variant prebuilt, and takes it rather than
    compiling at start."""
    import kvrelay.kernels

    module, _ = base_kernels
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setenv(cpu_build.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_build, "cpu_flags", lambda: ZEN1)
    monkeypatch.delattr(kvrelay.kernels, "_cpu_kernels_avx2", raising=False)
    monkeypatch.setitem(sys.modules, "kvrelay.kernels._cpu_kernels_avx2", None)  # not built: importing it fails
    monkeypatch.delattr(kvrelay.kernels, "_cpu_kernels_base", raising=False)
    monkeypatch.setitem(sys.modules, "kvrelay.kernels._cpu_kernels_base", module)
    ext = cpu_build.LazyExtension("t", cpu_build.CPU_KERNELS.sources, "the torch path")
    with caplog.at_level("INFO", logger=cpu_build.__name__):
        assert ext.load() is module
    assert (ext.origin, ext.variant) == ("prebuilt", "base")
    assert not (tmp_path / "cache").exists()  # nothing compiled
    assert "no prebuilt avx2 kernels (the best this CPU runs); taking the prebuilt base" in caplog.text


def test_a_killed_build_s_lock_is_removed_not_waited_on(base_kernels) -> None:
    module, cache = base_kernels
    assert not (cache / "base" / "lock").exists()
    assert module.build_id() == build_id(VARIANT_BY_NAME["base"], torch.__version__)


def test_a_build_held_too_long_by_another_process_is_given_up(tmp_path) -> None:
    with open(tmp_path / "avx2.lock", "w") as held:  # another builder: the kernel's lock on this file
        fcntl.flock(held, fcntl.LOCK_EX)
        import subprocess

        code = ("import sys; from pathlib import Path; from kvrelay.kernels import cpu_build; "
                "from kvrelay.kernels.isa import VARIANT_BY_NAME as V\n"
                "try:\n cpu_build.build(V['avx2'], cpu_build.CPU_KERNELS.sources, "
                f"Path({str(tmp_path)!r}), wait_s=1.0)\nexcept TimeoutError as e:\n print(e); sys.exit(3)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    assert out.stdout.strip() == (f"another process has been building the avx2 kernels in {tmp_path / 'avx2'} for "
                                  "over 1 s")


def test_a_prebuilt_module_is_taken_only_when_it_matches(base_kernels, monkeypatch: pytest.MonkeyPatch) -> None:
    """The module the fixture built, standing where ``pip install`` puts the base variant's."""
    module, _ = base_kernels
    base = VARIANT_BY_NAME["base"]
    monkeypatch.setitem(sys.modules, f"kvrelay.kernels.{module_name(base)}", module)
    assert cpu_build.prebuilt(base, build_id(base, torch.__version__)) is module
    assert cpu_build.prebuilt(base, build_id(base, "9.9.9")) is None  # built for another torch


def test_the_loaded_kernels_say_where_they_came_from() -> None:
    ext = cpu_build.CPU_KERNELS.load()
    assert ext is not None and cpu_build.CPU_KERNELS.origin in ("prebuilt", "built")
    variant = variant_for(cpu_flags())
    assert ext.build_id() == build_id(variant, torch.__version__)
