"""Building this package's C++ CPU kernels (`kernels/csrc/`) once per process, on first use.

Each kernel module holds one `LazyExtension`; its `load` compiles the source with torch's C++ extension builder
(cached per machine under ``~/.cache/torch_extensions``) the first time and returns the module, or None when
``KVRELAY_CPU_KERNELS=0`` turns the C++ kernels off or the build failed (logged once; callers keep their torch
path).
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math"]
DISABLE_ENV = "KVRELAY_CPU_KERNELS"


class LazyExtension:
    """``name``: the extension's module name; ``source``: its one C++ file; ``fallback``: what the callers use
    instead, for the log line."""

    def __init__(self, name: str, source: Path, fallback: str) -> None:
        self.name, self.source, self.fallback = name, source, fallback
        self._lock = threading.Lock()
        self._loaded: ModuleType | None = None
        self._tried = False

    def load(self) -> ModuleType | None:
        """The compiled extension (built on the first call in this process), or None when disabled or the build
        failed."""
        with self._lock:
            if self._tried:
                return self._loaded
            self._tried = True
            if os.environ.get(DISABLE_ENV, "1") == "0":
                log.info("%s=0: %s", DISABLE_ENV, self.fallback)
                return None
            try:
                from torch.utils.cpp_extension import load as build

                self._loaded = build(self.name, [str(self.source)], extra_cflags=CFLAGS, verbose=False)
            except Exception as exc:  # noqa: BLE001 - any build failure falls back to the torch path
                log.warning("could not build %s (%s); %s", self.source.name, exc, self.fallback)
                self._loaded = None
            return self._loaded
