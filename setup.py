"""The C++ CPU kernels, compiled at install: one extension per instruction-set variant (`kernels.isa.VARIANTS`), so
a serving machine needs no compiler and no start builds anything (`kernels.cpu_build` picks the variant its CPU
runs). Everything else is in ``pyproject.toml``.

They need torch's headers at build time: ``pip install --no-build-isolation .`` builds them against the torch
already installed (the one they will run with); without torch at build time (an isolated build), none is built and
the first start on each machine builds its variant instead (`kernels.cpu_build`). ``KVRELAY_BUILD_VARIANTS``
(comma-separated names; ``native``: the one this CPU runs; ``none``) limits what is built — ``make`` builds the
development machine's only (~30 s on 2 cores against ~2 min for all four).
"""

from __future__ import annotations

import os
import platform
import sys

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvrelay.kernels.isa import SOURCES, VARIANTS, compile_args, cpu_flags, module_name, variant_for  # noqa: E402


def _extensions() -> tuple[list, dict]:
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print("kvrelay: torch is not importable at build time; the C++ CPU kernels will be built on first use",
              file=sys.stderr)
        return [], {}
    wanted = os.environ.get("KVRELAY_BUILD_VARIANTS", "")
    names = [v.name for v in VARIANTS] if not wanted else [n.strip() for n in wanted.split(",") if n.strip()]
    names = [variant_for(cpu_flags()).name if n == "native" else n for n in names]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        names = [n for n in names if n == "base"]
    unknown = sorted(set(names) - {v.name for v in VARIANTS} - {"none"})
    if unknown:
        raise SystemExit(f"KVRELAY_BUILD_VARIANTS: unknown variant {unknown[0]!r}; "
                         f"use {', '.join(v.name for v in VARIANTS)}, native or none")
    sources = [f"kernels/csrc/{s}" for s in SOURCES]
    modules = [CppExtension(f"kvrelay.kernels.{module_name(v)}", sources, extra_compile_args=compile_args(v,
                                                                                                          torch.__version__),
                            extra_link_args=["-fopenmp"]) for v in VARIANTS if v.name in names]
    class PerVariantBuild(BuildExtension.with_options(use_ninja=True)):
        """Each variant's objects in a directory of their own: the variants compile the same sources."""

        def build_extension(self, ext: object) -> None:
            shared = self.build_temp
            self.build_temp = os.path.join(shared, ext.name.rpartition(".")[2])
            try:
                super().build_extension(ext)
            finally:
                self.build_temp = shared

    return modules, {"build_ext": PerVariantBuild}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
