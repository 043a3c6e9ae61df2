"""The C++ CPU kernels, compiled at install, so a serving machine needs no compiler and no start builds anything
(`kernels.cpu_build` loads them). Everything else is in ``pyproject.toml``.

Which instruction-set variants (`kernels.isa.VARIANTS`) is ``KVRELAY_BUILD_VARIANTS``'s choice
(`kernels.isa.build_names`): by default the one this machine runs, as vLLM's CPU build does from source — an install
is for the machine it runs on, and one variant compiles in ~30 s on 2 cores against ~2 min for all four. ``all``
builds every variant, for a wheel or an image that other CPUs will run; a CPU whose best variant was not built takes
the best one built that it can run.

They are built against the torch they will run with: the one importable at build time (``pip install
--no-build-isolation .``), else the one installed in the environment being installed into (pip's isolated build runs
that environment's interpreter with its site-packages hidden; they are searched for torch alone), else, in an
environment without torch, the build asks the frontend for torch (``setup_requires``, which setuptools' backend
turns into a build requirement) and pip installs the same release into the build environment as into the target
(the same requirement, resolved against the same indexes). A later torch upgrade makes the prebuilt modules stale:
the first start then builds its variant (`kernels.cpu_build`) and logs why.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import sysconfig

from setuptools import setup

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvrelay.kernels.isa import SOURCES, VARIANTS, build_names, compile_args, cpu_flags, module_name  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def _torch_requirement() -> str:
    """The runtime requirement on torch, as ``pyproject.toml`` states it (one source for both)."""
    with open(os.path.join(HERE, "pyproject.toml"), encoding="utf-8") as f:
        found = re.search(r'"(torch[<>=!~ ][^"]*)"', f.read())
    if found is None:
        raise SystemExit("setup.py: pyproject.toml names no torch requirement")
    return found.group(1)


def _find_torch() -> bool:
    """Whether torch can be imported, looking also in the target environment's site-packages (pip's isolated build
    hides them; the interpreter, and so ``sysconfig``'s paths, are the target's). Appended, not prepended: only a
    module the build environment lacks is taken from there."""
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        pass
    for directory in dict.fromkeys(sysconfig.get_paths()[k] for k in ("purelib", "platlib")):
        if os.path.isdir(os.path.join(directory, "torch")) and directory not in sys.path:
            sys.path.append(directory)
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False


def _extensions() -> tuple[list, dict, list[str]]:
    """(extension modules, command classes, build requirements still missing)."""
    try:
        names = build_names(os.environ.get("KVRELAY_BUILD_VARIANTS", ""), cpu_flags(), platform.machine())
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    if not names:
        return [], {}, []
    if not _find_torch():
        # setuptools' backend reports setup_requires to the frontend as build requirements, so this run only
        # asks for torch; the next (the wheel build) finds it
        return [], {}, [_torch_requirement()]
    import torch
    from torch.utils.cpp_extension import BuildExtension, CppExtension

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

    return modules, {"build_ext": PerVariantBuild}, []


ext_modules, cmdclass, setup_requires = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass, setup_requires=setup_requires)
