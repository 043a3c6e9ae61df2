"""Load a Hugging Face model directory into `LlamaForCausalLM`, and fingerprint it.

A model directory holds ``config.json`` and either one ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (``{"weight_map": {tensor name: shard file}}``). Tensors are
matched to parameters by name, converted to the requested dtype and device one at a time, so peak
memory is the model plus one tensor. No network access, ever.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from kvrelay.model.config import ModelConfig, read_model_config
from kvrelay.model.dtype import DTYPE_NAME_TO_TORCH, resolve_dtype
from kvrelay.model.llama import LlamaForCausalLM
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FINGERPRINT_CACHE = ".kvrelay-fingerprint.json"  # per weight file: size, mtime_ns, sha256
TIED_HEAD = "lm_head.weight"
TIED_SOURCE = "model.embed_tokens.weight"


@dataclass(frozen=True, slots=True)
class LoadedModel:
    """A model ready for inference.

    Attributes:
        config: the parsed ``config.json``.
        model: in eval mode, parameters without grad, on the requested device and dtype.
        fingerprint: `model_fingerprint` of the directory (goes into `BlockSpec.model_fingerprint`).
        model_dir: where it was loaded from.
    """

    config: ModelConfig
    model: LlamaForCausalLM
    fingerprint: str
    model_dir: Path


def load_model(
    model_dir: str | Path, *, dtype: str = "float32", device: str | torch.device = "cpu"
) -> LoadedModel:
    """Load ``model_dir`` (see module doc).

    Tensors in the checkpoint that the model has no parameter for (e.g. rotary ``inv_freq``
    buffers) are ignored and counted in one warning. With ``tie_word_embeddings`` and no
    ``lm_head.weight`` tensor, the head shares the embedding matrix.

    Raises:
        FileNotFoundError: no ``config.json``, no weights file, or a shard the index names is absent.
        ValueError: unsupported architecture or dtype (``auto``: see `model.dtype.resolve_dtype`); quantized
            (MXFP4) expert tensors; a
            parameter has no tensor in the checkpoint (named, with the directory); a tensor's shape
            differs from the parameter's (named, with expected and found shapes and the file).
    """
    model_dir = Path(model_dir)
    torch_dtype = DTYPE_NAME_TO_TORCH[resolve_dtype(dtype, device)]
    config = read_model_config(model_dir)
    name_to_file = _tensor_files(model_dir)
    quantized = sorted(n for n in name_to_file if n.endswith(("_blocks", "_scales")) and ".experts." in n)
    if quantized:
        raise ValueError(f"{model_dir}: the experts are stored quantized ({quantized[0]!r}, MXFP4 as gpt-oss "
                         f"releases them), which kvrelay does not read; use a bf16 checkpoint of the model")
    fp8 = sorted(n for n in name_to_file if n.endswith("_scale_inv"))
    if fp8:
        raise ValueError(f"{model_dir}: the weights are stored as FP8 with block scales ({fp8[0]!r}, as DeepSeek-V3 "
                         f"releases them), which kvrelay does not read; convert the checkpoint to bf16 first")
    with torch.device("meta"), _no_weight_init():
        model = LlamaForCausalLM(config)
    name_to_param = dict(model.named_parameters())
    file_to_names: dict[Path, list[str]] = {}
    for name, path in name_to_file.items():
        file_to_names.setdefault(path, []).append(name)
    unexpected = 0
    with tqdm(total=len(name_to_file), desc=f"loading {model_dir.name}", unit="tensor", disable=None) as bar:
        for path in sorted(file_to_names):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in sorted(file_to_names[path]):
                    bar.update(1)
                    param = name_to_param.get(name)
                    if param is None:
                        unexpected += 1
                        continue
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"tensor {name!r} in {path} has shape {tuple(tensor.shape)}; "
                            f"the model expects {tuple(param.shape)} (check config.json against the weights)"
                        )
                    keep = name.endswith(model.float32_parameters)  # routing that must stay float32
                    _assign(model, name, tensor.to(device=device, dtype=torch.float32 if keep else torch_dtype))
    if unexpected:
        logger.warning("%s: ignored %d checkpoint tensors the model does not use", model_dir, unexpected)
    if config.tie_word_embeddings and TIED_HEAD not in name_to_file:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [name for name, p in model.named_parameters(remove_duplicate=False) if p.is_meta]
    if missing:
        raise ValueError(
            f"{model_dir}: the checkpoint has no tensor {missing[0]!r}"
            + (f" (and {len(missing) - 1} more missing)" if len(missing) > 1 else "")
        )
    model.to(device=device)  # moves the rope buffer; parameters are already there
    model.eval().requires_grad_(False)
    model.prepare_for_inference()
    fingerprint = model_fingerprint(model_dir)
    return LoadedModel(config=config, model=model, fingerprint=fingerprint, model_dir=model_dir)


@contextmanager
def _no_weight_init() -> Iterator[None]:
    """Modules built inside skip their random initialisation (every in-place ``torch.nn.init`` function does
    nothing), as transformers' ``no_init_weights`` does: the checkpoint overwrites every parameter, and a random
    fill on the meta device goes through torch's reference ops, whose first use imports ``torch._dynamo``
    (~1.4 s of CPU in every node that loads a model). It patches ``torch.nn.init`` for the whole process while
    inside: no other thread may build modules meanwhile (a load does, at start-up)."""
    names = [n for n in dir(nn.init) if n.endswith("_") and not n.startswith("_") and callable(getattr(nn.init, n))]
    saved = {n: getattr(nn.init, n) for n in names}

    def keep(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return tensor

    for n in names:
        setattr(nn.init, n, keep)
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(nn.init, n, fn)


def _assign(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, nn.Parameter(tensor, requires_grad=False))


def _weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of ``model_dir``, sorted by name."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return sorted({model_dir / f for f in weight_map.values()})
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    """Tensor name → the safetensors file holding it."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        name_to_file = {name: model_dir / f for name, f in weight_map.items()}
        for path in sorted(set(name_to_file.values())):
            if not path.is_file():
                raise FileNotFoundError(f"{index} names shard {path.name}, which is missing from {model_dir}")
        return name_to_file
    (single,) = _weight_files(model_dir)
    with safe_open(str(single), framework="pt", device="cpu") as f:
        return {name: single for name in f.keys()}


def model_fingerprint(model_dir: str | Path) -> str:
    """Hex SHA-256 naming a model directory's content: ``config.json`` and every byte of every weight
    file (name, size and SHA-256 of each, in name order). Weights replaced in place get a new
    fingerprint, so KV computed with the old ones (in any tier, on disk too) is never served again.

    Hashing a large checkpoint takes a while (about a second per GiB), so each file's digest is cached
    in ``FINGERPRINT_CACHE`` next to the files, keyed by name, size, inode and modification and status-change
    times (nanoseconds): a file rewritten in place, or replaced by a copy that keeps the old size and mtime
    (``cp -p``, ``rsync -t``, ``os.utime``), has a new ctime (which no user call can set back) or inode and is
    hashed again. An unwritable directory is hashed at every load.

    Raises:
        FileNotFoundError: no ``config.json`` or no weights (see `load_model`).
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found; a model directory needs a config.json")
    h = hashlib.sha256(b"kvrelay.model.v2")
    config_bytes = config_path.read_bytes()
    h.update(len(config_bytes).to_bytes(8, "little") + config_bytes)
    cache_path = model_dir / FINGERPRINT_CACHE
    try:
        cache = json.loads(cache_path.read_text())
        if not isinstance(cache, dict):
            cache = {}
    except (OSError, ValueError):
        cache = {}
    fresh: dict[str, dict[str, object]] = {}
    for path in _weight_files(model_dir):
        st = path.stat()
        entry = cache.get(path.name)
        stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}
        if not (isinstance(entry, dict) and all(entry.get(k) == v for k, v in stamp.items())
                and isinstance(entry.get("sha256"), str)):
            with path.open("rb") as f:
                entry = {**stamp, "sha256": hashlib.file_digest(f, "sha256").hexdigest()}
        fresh[path.name] = entry
        name = path.name.encode()
        h.update(len(name).to_bytes(8, "little") + name + st.st_size.to_bytes(8, "little")
                 + bytes.fromhex(str(entry["sha256"])))
    if fresh != cache:
        try:
            tmp = cache_path.with_name(cache_path.name + f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(fresh, indent=1, sort_keys=True))
            tmp.replace(cache_path)
        except OSError:
            pass  # read-only model directory: hash again next time
    return h.hexdigest()
