"""`GenerationDefaults`: the sampling defaults a model's ``generation_config.json`` sets, read as vLLM's
``--generation-config auto`` reads them (``vllm``: vLLM's neutral defaults, the file ignored). No torch: the router
builds these.

    mode    temperature / top_p / top_k / min_p / repetition_penalty      max_tokens          extra EOS ids
    auto    the file's, where it sets one to other than HF's default      its max_new_tokens  its eos_token_id
    vllm    1.0 / 1.0 / 0 / 0.0 / 1.0                                     none                none

A request's own value always wins; these fill the fields it leaves out.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GENERATION_CONFIG_MODES = ("auto", "vllm")
# transformers' GenerationConfig defaults: vLLM reads the file's diff from them (`to_diff_dict`), so a file that
# states a default (top_k 50 is HF's, not vLLM's) changes nothing.
_HF_DEFAULTS: dict[str, float | int | None] = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None,
                                               "repetition_penalty": 1.0}


class GenerationConfigError(ValueError):
    """``generation_config.json`` is unreadable or holds a value no request could take; names the field."""


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Defaults for the sampling fields a request leaves out. ``max_tokens``: a cap on the default length
    (None: the rest of the context, or 16 for completions); ``eos_token_ids``: every id the file names as an
    end of sequence (the router adds those the engine does not stop on to ``stop_token_ids``, unless
    ``ignore_eos``); ``applied``: what came from the file, for the start-up log (empty for ``vllm``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    applied: tuple[tuple[str, Any], ...] = ()


def load_generation_defaults(model_dir: str | Path, mode: str) -> GenerationDefaults:
    """The defaults for ``model_dir`` under ``mode`` (`GENERATION_CONFIG_MODES`). A missing file is no defaults.

    Raises:
        ValueError: an unknown mode.
        GenerationConfigError: a file that is not JSON, or a value out of a request's range, naming the field.
    """
    if mode not in GENERATION_CONFIG_MODES:
        raise ValueError(f"generation config mode must be one of {', '.join(GENERATION_CONFIG_MODES)}, got {mode!r}")
    path = Path(model_dir) / "generation_config.json"
    if mode == "vllm" or not path.is_file():
        return GenerationDefaults()
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GenerationConfigError(f"{path}: not readable JSON ({exc}); fix it or serve with "
                                    "--generation-config vllm") from None
    if not isinstance(raw, dict):
        raise GenerationConfigError(f"{path}: expected a JSON object")
    values: dict[str, Any] = {}
    for name, hf_default in _HF_DEFAULTS.items():
        value = raw.get(name)
        if value is None or value == hf_default:
            continue
        values[name] = _checked(path, name, value)
    max_new = raw.get("max_new_tokens")
    if max_new is not None:
        if isinstance(max_new, bool) or not isinstance(max_new, int) or max_new < 1:
            raise GenerationConfigError(f"{path}: max_new_tokens must be a positive integer, got {max_new!r}")
        values["max_tokens"] = max_new
    eos = raw.get("eos_token_id")
    eos_ids = (eos,) if isinstance(eos, int) and not isinstance(eos, bool) else tuple(eos or ())
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos_ids):
        raise GenerationConfigError(f"{path}: eos_token_id must be a token id or a list of them, got {eos!r}")
    applied = tuple(sorted(values.items()))
    if eos_ids:
        applied += (("eos_token_id", list(eos_ids)),)
    return GenerationDefaults(**values, eos_token_ids=eos_ids, applied=applied)


def _checked(path: Path, name: str, value: Any) -> float | int:
    """``value`` of field ``name`` in a request's range (the router's bounds), as a float (top_k: an int)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise GenerationConfigError(f"{path}: {name} must be a number, got {value!r}")
    ok = {"temperature": 0 <= value <= 2, "top_p": 0 < value <= 1, "top_k": value >= -1 and value == int(value),
          "min_p": 0 <= value <= 1, "repetition_penalty": 0 < value <= 2}[name]
    if not ok:
        raise GenerationConfigError(f"{path}: {name} {value!r} is out of range; fix it or serve with "
                                    "--generation-config vllm")
    return max(int(value), 0) if name == "top_k" else float(value)
