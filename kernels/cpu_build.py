"""Loading this package's C++ CPU kernels (`kernels/csrc/`): prebuilt at install, else built once per machine.

All of them are one extension, `CPU_KERNELS` (`kernels.cpu_small` and `kernels.cpu_attention` call into it), in the
instruction-set variant this CPU runs (`kernels.isa`: AVX512-BF16, AVX-512, AVX2 or plain C++). `LazyExtension.load`
returns, on its first call in a process:

1. the variant's prebuilt module ``kernels._cpu_kernels_<variant>``, compiled by ``pip install`` (``setup.py``: this
   machine's variant, or every one with ``KVRELAY_BUILD_VARIANTS=all``) — taken only when its `kernels.isa.build_id`
   matches the sources and torch beside it (an edited source or another torch builds again instead); where it was
   not built (a wheel made on another CPU), the best prebuilt variant this CPU runs, logged, rather than a build;
2. else a build on this machine with torch's extension builder, cached under ``KVRELAY_KERNEL_CACHE`` (default
   ``~/.cache/kvrelay/kernels``) per torch version and variant, so a cache shared by different CPUs keeps one build
   each. Builders take turns on a file lock the kernel frees when its holder dies; a process that holds it and
   finds torch's own lock file in the build directory removes it (it can only be left by a build killed midway,
   which would otherwise hang every later start); a process that waits longer than ``BUILD_WAIT_S`` for another's
   build gives up;
3. else None: ``KVRELAY_CPU_KERNELS=0``, no compiler, a failed build or a wait given up (logged once) — callers keep
   their torch path.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from pathlib import Path
from types import ModuleType

from kvrelay.kernels.isa import CSRC, SOURCES, IsaVariant, compile_args, cpu_flags, module_name, runnable
from kvrelay.kernels.isa import build_id as isa_build_id

log = logging.getLogger(__name__)
DISABLE_ENV = "KVRELAY_CPU_KERNELS"
CACHE_ENV = "KVRELAY_KERNEL_CACHE"
BUILD_WAIT_S = 600.0  # a cold build takes ~12-40 s on 2 cores; a holder this long is stuck, not building
POLL_S = 0.2


def default_cache_dir() -> Path:
    """``KVRELAY_KERNEL_CACHE``, else ``~/.cache/kvrelay/kernels``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvrelay" / "kernels")


class LazyExtension:
    """``name``: the extension's name; ``sources``: its C++ files (one of them defines the Python module);
    ``fallback``: what the callers use instead, for the log line. The variant comes from this CPU's flags
    (`kernels.isa.variant_for`)."""

    def __init__(self, name: str, sources: list[Path], fallback: str) -> None:
        self.name, self.sources, self.fallback = name, sources, fallback
        self._lock = threading.Lock()
        self._loaded: ModuleType | None = None
        self._tried = False
        self.origin = ""  # "prebuilt" or "built" once loaded: where the module came from
        self.variant = ""  # the `kernels.isa` variant loaded (not always the CPU's best: see the module doc)

    def load(self) -> ModuleType | None:
        """The extension (see module doc), or None when disabled or neither prebuilt nor buildable."""
        with self._lock:
            if self._tried:
                return self._loaded
            self._tried = True
            if os.environ.get(DISABLE_ENV, "1") == "0":
                log.info("%s=0: %s", DISABLE_ENV, self.fallback)
                return None
            try:
                import torch

                candidates = runnable(cpu_flags())
                found = next(((v, m) for v in candidates
                              if (m := prebuilt(v, isa_build_id(v, torch.__version__))) is not None), None)
                if found is not None:
                    (variant, self._loaded), self.origin = found, "prebuilt"
                    if variant is not candidates[0]:
                        log.info("no prebuilt %s kernels (the best this CPU runs); taking the prebuilt %s: "
                                 "KVRELAY_BUILD_VARIANTS=native (or all) at install builds %s",
                                 candidates[0].name, variant.name, candidates[0].name)
                else:
                    variant = candidates[0]
                    self._loaded = build(variant, self.sources, default_cache_dir() / f"torch-{torch.__version__}",
                                         wait_s=BUILD_WAIT_S)
                    self.origin = "built"
                self.variant = variant.name
                log.info("C++ CPU kernels: %s, %s", variant.name, self.origin)
            except Exception as exc:  # noqa: BLE001 - any failure falls back to the torch path
                log.warning("could not load or build %s (%s); %s", ", ".join(s.name for s in self.sources), exc,
                            self.fallback)
                self._loaded = None
            return self._loaded


def prebuilt(variant: IsaVariant, want: str) -> ModuleType | None:
    """The variant's module compiled at install (``kernels._cpu_kernels_<variant>``), or None when there is none or
    it was built from other sources or for another torch (its ``build_id()`` is not ``want``)."""
    try:
        module = _import_prebuilt(variant.name)
    except ImportError:
        return None
    got = module.build_id()
    if got != want:
        log.info("the prebuilt %s kernels are from other sources or another torch (%s, not %s); not taken",
                 variant.name, got, want)
        return None
    return module


def _import_prebuilt(name: str) -> ModuleType:
    """``kernels._cpu_kernels_<name>`` (`kernels.isa.module_name`), named in full: no import here is computed.

    Raises:
        ImportError: not built at install (or built for another Python).
    """
    if name == "avx512bf16":
        from kvrelay.kernels import _cpu_kernels_avx512bf16 as module  # type: ignore[attr-defined]
    elif name == "avx512":
        from kvrelay.kernels import _cpu_kernels_avx512 as module  # type: ignore[attr-defined]
    elif name == "avx2":
        from kvrelay.kernels import _cpu_kernels_avx2 as module  # type: ignore[attr-defined]
    elif name == "base":
        from kvrelay.kernels import _cpu_kernels_base as module  # type: ignore[attr-defined]
    else:
        raise ImportError(f"no variant {name!r}")
    return module


def build(variant: IsaVariant, sources: list[Path], cache: Path, *, wait_s: float) -> ModuleType:
    """``variant``'s module built with torch's extension builder into ``cache / <variant>`` (reused when up to date),
    holding ``cache / <variant>.lock`` while it builds (see module doc).

    Raises:
        TimeoutError: another process held the lock for ``wait_s``.
        RuntimeError, OSError: the build failed.
    """
    import torch
    from torch.utils.cpp_extension import load

    directory = cache / variant.name
    directory.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{variant.name}.lock", "w") as lock:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process has been building the {variant.name} kernels in "
                                       f"{directory} for over {wait_s:.0f} s") from None
                time.sleep(POLL_S)
        # every builder holds the flock first, so torch's own lock file here is a killed build's leftover
        baton = directory / "lock"
        if baton.exists():
            log.warning("removing %s, left by a build that did not finish", baton)
            baton.unlink()
        return load(module_name(variant), [str(s) for s in sources],
                    extra_cflags=compile_args(variant, torch.__version__), build_directory=str(directory),
                    verbose=False)


CPU_KERNELS = LazyExtension("kvrelay_cpu_kernels", [CSRC / s for s in SOURCES],
                            "F.linear, torch's RMSNorm, decode attention through torch ops and prefill "
                            "attention through SDPA instead")
