"""Rotary position embeddings, computed exactly as transformers computes them.

Non-interleaved ("rotate_half") convention: a head vector ``x = [x1 | x2]`` (two halves of
``head_dim / 2``) at position ``p`` becomes ``x * cos + [-x2 | x1] * sin`` where
``cos = cos([p * inv_freq | p * inv_freq])`` and likewise ``sin``.

The frequencies follow ``transformers.modeling_rope_utils`` for the supported rope types; the
angles are computed in float32 and cast to the activations' dtype, as transformers does.
"""

from __future__ import annotations

import math

import torch
from kvrelay.model.config import RopeConfig


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies ``[head_dim // 2]`` float32 on CPU.

    * ``default``: ``1 / theta ** (2i / head_dim)``.
    * ``linear``: the default divided by ``factor``.
    * ``llama3``: wavelengths longer than ``original / low_freq_factor`` are divided by ``factor``,
      those shorter than ``original / high_freq_factor`` are kept, and the band between is
      interpolated smoothly (Llama 3.1).
    * ``yarn``: a linear ramp between the default (extrapolated) frequencies and those divided by
      ``factor`` (interpolated), over the dimensions between the ``beta_fast`` and ``beta_slow``
      correction points; cos and sin are then scaled by ``rope.attention_factor`` (`rotary_cos_sin`).

    Raises:
        ValueError: an unknown ``rope.rope_type``.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn(rope, head_dim)
    raise ValueError(f"rope type {rope.rope_type!r} is not supported")


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_context = rope.original_max_position_embeddings
    low_freq_wavelen = old_context / rope.low_freq_factor
    high_freq_wavelen = old_context / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    """transformers' ``_compute_yarn_parameters`` inverse frequencies (full rotary)."""
    base, original = rope.theta, rope.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").to(torch.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (rope.factor * pos_freqs)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def rotary_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, *, dtype: torch.dtype, scaling: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin``: ``[T, head_dim]`` in ``dtype`` for integer ``positions`` ``[T]``, multiplied by
    ``scaling`` (yarn's attention factor; 1.0 otherwise) in float32 before the cast.

    ``inv_freq`` must be on ``positions.device``. Angles are computed in float32.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    if scaling != 1.0:
        return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, head_dim]`` by ``cos, sin`` ``[T, head_dim]``; returns a new tensor."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RotaryRows:
    """`rotary_cos_sin` of positions 0 .. n-1 kept as two tables ``[n, head_dim]`` of one dtype on the CPU, grown
    on demand, so that a decode step reads its tokens' rows instead of running the ~7 torch ops of
    `rotary_cos_sin` (run cold after the step has streamed the weights, those took ~0.1 ms of a batch-1 bf16
    SmolLM2 step on a Zen 4 VM).

    A row holds the bits `rotary_cos_sin` gives that position in any step, where ``head_dim`` (twice
    ``inv_freq``'s length) is a multiple of 32: torch computes cos and sin of float32 vectors 32 lanes at a time
    and the leftover lanes with the C library's functions, which may differ in the last bit; a step's ``T x
    head_dim`` values then have no leftover, nor do the table's chunks (`CHUNK_VALUES`, computed one call each).
    Other widths are not tabled (`tabled` False): `rows` computes the step's own. The tables hold every position up
    to the highest asked for (doubling as they grow): ``2 x positions x head_dim`` values, 2 MiB for SmolLM2's 8k
    context in bf16, 64 MiB for a 128k context at ``head_dim`` 128.
    """

    CHUNK_VALUES = 32768  # values per chunk of positions: torch runs an elementwise op this size on one thread

    def __init__(self, inv_freq: torch.Tensor, *, dtype: torch.dtype, scaling: float = 1.0) -> None:
        self.inv_freq, self.dtype, self.scaling = inv_freq, dtype, scaling
        self.width = 2 * inv_freq.numel()
        self.tabled = self.width % 32 == 0 and inv_freq.device.type == "cpu"
        self.cos = torch.empty(0, self.width, dtype=dtype)
        self.sin = torch.empty(0, self.width, dtype=dtype)

    def rows(self, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """``cos, sin, rows``: tables ``[R, head_dim]`` and, for each position, the row of the tables that holds
        its values (the position itself where `tabled`; else the step's own rows, computed now)."""
        if not self.tabled:
            cos, sin = rotary_cos_sin(self.inv_freq, torch.tensor(positions, dtype=torch.int64), dtype=self.dtype,
                                      scaling=self.scaling)
            return cos, sin, list(range(len(positions)))
        need = max(positions) + 1
        if need > self.cos.shape[0]:
            self._grow(max(need, 2 * self.cos.shape[0], 512))
        return self.cos, self.sin, positions

    def _grow(self, n: int) -> None:
        per_chunk = max(1, self.CHUNK_VALUES // self.width)
        cos, sin = [self.cos], [self.sin]
        for start in range(self.cos.shape[0], n, per_chunk):
            c, s = rotary_cos_sin(self.inv_freq, torch.arange(start, min(n, start + per_chunk)), dtype=self.dtype,
                                  scaling=self.scaling)
            cos.append(c)
            sin.append(s)
        self.cos, self.sin = torch.cat(cos), torch.cat(sin)
