"""Shared pieces of the benchmarks: trace loading, tiny-model setup, JSON output."""

from __future__ import annotations

import json
import os
import platform
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

# Shipped with the repository (source, license and checksum in benchmarks/traces/README.md).
DEFAULT_TRACE = Path(__file__).resolve().parent / "traces" / "conversation_trace.jsonl"


@dataclass(frozen=True, slots=True)
class TraceRequest:
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def find_trace(path: str | None = None) -> Path:
    """The trace to replay: ``path`` if given, else ``KVRELAY_TRACE`` if set, else the Mooncake
    conversation trace shipped in ``benchmarks/traces/``.

    Raises:
        FileNotFoundError: the chosen file does not exist (naming it and where the choice came from).
    """
    if path:
        chosen, origin = Path(path), "--trace"
    elif os.environ.get("KVRELAY_TRACE"):
        chosen, origin = Path(os.environ["KVRELAY_TRACE"]), "KVRELAY_TRACE"
    else:
        chosen, origin = DEFAULT_TRACE, "the shipped trace"
    if not chosen.is_file():
        raise FileNotFoundError(f"trace file {chosen} ({origin}) does not exist")
    return chosen


def read_trace(path: str | None = None, *, limit: int | None = None) -> Iterator[TraceRequest]:
    with find_trace(path).open() as f:
        for i, line in enumerate(f):
            if limit is not None and i >= limit:
                break
            row = json.loads(line)
            yield TraceRequest(int(row["timestamp"]), int(row["input_length"]), int(row["output_length"]),
                               tuple(int(h) for h in row["hash_ids"]))


def machine_label() -> dict[str, str | int]:
    return {
        "machine": platform.machine(),
        "cpus": os.cpu_count() or 0,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
    }


def ensure_tiny_model(model_dir: str | None, *, seed: int = 0, arch: str = "llama", **shape: int) -> str:
    """``model_dir`` if given, else a tiny model of family ``arch`` (`model.tiny.write_tiny_model`, with
    ``shape``'s layers/hidden/... overrides) written once under ``.models/bench-tiny-…``."""
    if model_dir:
        return model_dir
    from kvrelay.model.tiny import write_tiny_model

    name = f"bench-tiny-{seed}" if arch == "llama" and not shape else f"bench-tiny-{arch}-{seed}"
    name += "".join(f"-{k}{v}" for k, v in sorted(shape.items()))
    out = Path(".models") / name
    if not (out / "config.json").exists():
        write_tiny_model(out, seed=seed, arch=arch, **shape)
    return str(out)


def emit(result: dict, out_path: str | None) -> None:
    """Print ``result`` as JSON and write it to ``out_path`` if given."""
    text = json.dumps(result, indent=2)
    print(text)
    if out_path:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        Path(out_path).write_text(text + "\n")


def seeded_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(length)]
