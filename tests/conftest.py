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
    from model.tiny import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="session")
def smollm2() -> RealModel:
    """SmolLM2-135M-Instruct pulled as float32 (cached per machine; see `tests.real_model`)."""
    return real_model()
