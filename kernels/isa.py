"""Which build of the C++ CPU kernels this CPU can run: the instruction-set variants they are compiled in.

The kernels branch at compile time on AVX512-BF16, AVX-512, AVX2 and FMA (``kernels/csrc``), so each variant is one
build with those instructions named on the command line — not ``-march=native``, which ties a build (and a cache or
a wheel shared between machines) to the CPU it was made on. `variant_for` picks, at run time, the best variant the
CPU's flags allow; ``KVRELAY_CPU_ISA=<name>`` forces one (a CPU without its instructions would fault).

No torch here: ``setup.py`` imports this to build the variants before torch's extension machinery runs.
"""

from __future__ import annotations

import hashlib
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "KVRELAY_CPU_ISA"
CSRC = Path(__file__).parent / "csrc"
SOURCES = ("small_ops.cpp", "decode_attention.cpp", "decode_layer.cpp", "prefill_attention.cpp")
# -ffast-math: glibc's vector exp in the attention (scores are finite by construction; see cpu_attention.py)
# -g0: no debug info, which Python's build flags ask for with -g: ~30% of each file's compile time, and the
# module (14 MB with it) is what a wheel carries four times; -g never changes the code generated
BASE_CFLAGS = ("-O3", "-fopenmp", "-ffast-math", "-g0")


@dataclass(frozen=True, slots=True)
class IsaVariant:
    """One build: its ``name`` (in module and cache names), the ``/proc/cpuinfo`` flags a CPU needs to run it, and
    the compiler flags that turn those instructions on."""

    name: str
    needs: frozenset[str]
    cflags: tuple[str, ...]


_AVX2 = ("-mavx2", "-mfma", "-mf16c", "-mbmi", "-mbmi2", "-mpopcnt")
_AVX512 = (*_AVX2, "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512cd")
# Best first: the first whose flags a CPU has is the one it runs.
VARIANTS: tuple[IsaVariant, ...] = (
    IsaVariant("avx512bf16", frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "popcnt", "avx512f", "avx512bw",
                                        "avx512vl", "avx512dq", "avx512cd", "avx512_bf16"}),
               (*_AVX512, "-mavx512bf16")),
    IsaVariant("avx512", frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "popcnt", "avx512f", "avx512bw",
                                    "avx512vl", "avx512dq", "avx512cd"}), _AVX512),
    IsaVariant("avx2", frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "popcnt"}), _AVX2),
    IsaVariant("base", frozenset(), ()),  # plain C++ (x86-64's SSE2, or any other architecture)
)
VARIANT_BY_NAME = {v.name: v for v in VARIANTS}


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's ``flags`` in ``cpuinfo`` (empty where there is no such file or line, or off x86)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def runnable(flags: frozenset[str]) -> list[IsaVariant]:
    """The `VARIANTS` a CPU with ``flags`` runs, best first (the order in which a loader takes prebuilt modules), or
    only the one ``KVRELAY_CPU_ISA`` names (a CPU without its instructions would fault).

    Raises:
        ValueError: ``KVRELAY_CPU_ISA`` names no variant.
    """
    forced = os.environ.get(ISA_ENV)
    if forced:
        if forced not in VARIANT_BY_NAME:
            raise ValueError(f"{ISA_ENV}={forced!r}: use one of {', '.join(VARIANT_BY_NAME)}")
        return [VARIANT_BY_NAME[forced]]
    return [v for v in VARIANTS if v.needs <= flags]  # never empty: ``base`` needs nothing


def variant_for(flags: frozenset[str]) -> IsaVariant:
    """The best variant a CPU with ``flags`` runs, or the one ``KVRELAY_CPU_ISA`` names: `runnable`'s first.

    Raises:
        ValueError: ``KVRELAY_CPU_ISA`` names no variant.
    """
    return runnable(flags)[0]


def build_names(spec: str, flags: frozenset[str], machine: str) -> list[str]:
    """The variants an install builds, from ``KVRELAY_BUILD_VARIANTS`` (``spec``): empty or ``native``, the one
    this build machine runs (what vLLM's CPU build does from source: an install is for the machine it runs on);
    ``all``, every variant (a wheel or image for other CPUs); ``none``; or comma-separated names, ``native`` among
    them. Off x86-64 only ``base`` can be built.

    Raises:
        ValueError: a name that is no variant.
    """
    spec = spec.strip()
    if spec == "none":
        return []
    wanted = [n.strip() for n in (spec or "native").split(",") if n.strip()]
    names: list[str] = []
    for name in wanted:
        if name not in (*VARIANT_BY_NAME, "native", "all"):
            raise ValueError(f"KVRELAY_BUILD_VARIANTS: unknown variant {name!r}; use "
                             f"{', '.join(VARIANT_BY_NAME)}, native, all or none")
        more = [v.name for v in VARIANTS] if name == "all" else [variant_for(flags).name if name == "native" else name]
        names += [n for n in more if n not in names]
    if machine.lower() not in ("x86_64", "amd64"):
        names = [n for n in names if n == "base"]
    return names


def build_id(variant: IsaVariant, torch_version: str) -> str:
    """A digest of what a build of ``variant`` is made from: the sources and headers in ``kernels/csrc``, the flags
    and torch's version (a module built against another torch's headers must not be loaded). A prebuilt module
    carries it (``build_id()``); the loader takes the module only when it matches the files beside it."""
    digest = hashlib.sha256()
    for path in sorted(CSRC.glob("*.cpp")) + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join((*BASE_CFLAGS, *variant.cflags, torch_version)).encode())
    return "b" + digest.hexdigest()[:24]


def module_name(variant: IsaVariant) -> str:
    """The Python module name of ``variant``'s build (prebuilt: ``kernels.<name>``; built on first use: top-level)."""
    return f"_cpu_kernels_{variant.name}"


def compile_args(variant: IsaVariant, torch_version: str) -> list[str]:
    """The compiler flags of ``variant``'s build, its `build_id` defined for the module to report."""
    return [*BASE_CFLAGS, *variant.cflags, f"-DKVRELAY_BUILD_ID={build_id(variant, torch_version)}"]
