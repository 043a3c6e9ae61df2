"""kvrelay: ``from kvrelay import LLM, SamplingParams`` (see `kvrelay.llm`); the system's packages are
``kvrelay.engine``, ``kvrelay.router``, ``kvrelay.kernels``, ... and the servers the ``kvrelay`` command
(`kvrelay.deploy.cli`).

The repository keeps each package in a top-level folder (``engine/``, ``router/``, ...); an installed wheel maps them
under ``kvrelay/`` (``pyproject.toml``'s ``package-dir``). Run from a source tree (tests, ``python -m
kvrelay.deploy.cli`` in a checkout), this package's path also holds the tree's root, so ``kvrelay.engine`` is
``engine/`` there. The exports below load on first use: the router imports ``kvrelay.router`` without torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and (_ROOT / "engine" / "__init__.py").is_file():  # a source tree
    __path__.append(str(_ROOT))  # noqa: F821 - the package's own __path__

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "StructuredOutput", "StructuredOutputsParams"]


def __getattr__(name: str) -> Any:
    """The exports, imported on first use (PEP 562)."""
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from kvrelay import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from kvrelay.sampling_params import SamplingParams

        return SamplingParams
    if name in ("StructuredOutput", "StructuredOutputsParams"):
        from kvrelay.model import structured

        return getattr(structured, name)
    raise AttributeError(f"module 'kvrelay' has no attribute {name!r}")
