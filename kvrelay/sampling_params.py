"""The public ``kvrelay.SamplingParams``: the engine's `model.sampling_params.SamplingParams` with vLLM's defaults.

vLLM's ``SamplingParams()`` samples at ``temperature=1.0``; the engine's class is greedy by default (what its
callers and tests mean when they leave temperature out). Every other default is already vLLM's (``max_tokens``
16, ``top_p`` 1, ``top_k`` 0 = off, ``min_p`` 0, no penalties). An instance is an engine ``SamplingParams``
(a subclass), so the engine, the wire and ``dataclasses.replace`` take it as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.model.sampling_params import SamplingParams as EngineSamplingParams


@dataclass(frozen=True, slots=True)
class SamplingParams(EngineSamplingParams):
    """vLLM's ``SamplingParams``: as `model.sampling_params.SamplingParams`, but ``temperature`` defaults to 1.0
    (pass ``temperature=0`` for greedy)."""

    temperature: float = 1.0


__all__ = ["SamplingParams"]
