"""Shared fixtures: small Hugging Face checkpoints built by the tests (never downloaded)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton reads this when it is first imported (anything may import it: transformers, torch), so it is set
# here, before any test module loads. With CUDA present the kernels compile for the GPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


from tests.hf_models import build_hf_model
from tests.real_model import RealModel, real_model


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """``hf_model_dir(name)`` → a saved checkpoint of ``HF_CONFIGS[name]`` (built once per session)."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = build_hf_model(name, tmp_path_factory.mktemp(name))
        return cache[name]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``kvrelay tiny-model`` output with default settings."""
    from kvrelay.model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    """SmolLM2-135M-Instruct pulled as float32 (cached per machine; see `tests.real_model`)."""
    return real_model()


def _hub_kernels_problem() -> str | None:
    """Why transformers cannot be imported beside this project, or None: Hugging Face's ``kernels``
    distribution (transformers 5.25+ requires it) has the import name of our top-level ``kernels`` package,
    so transformers finds the distribution, imports ours, and every parity test fails at import."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("kernels")
    except PackageNotFoundError:
        return None
    return ("Hugging Face's `kernels` package is installed in this environment; its import name is this "
            "project's kernels/ package, so transformers imports ours and fails. `pip uninstall kernels` and "
            "keep transformers < 5.25 (pyproject.toml's test extra; `make test` does both)")


def pytest_configure(config: pytest.Config) -> None:
    if (problem := _hub_kernels_problem()) is not None:
        raise pytest.UsageError(problem)
