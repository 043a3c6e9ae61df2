"""`StepRates`: how fast this engine computes, measured from its own steps (decayed averages).

A router predicts waits from them (queued prompt tokens over the prefill rate, queued output tokens over
the decode rate) and a node reports them in its event answers; nothing here is configured by hand.

    step with prefill tokens   →  prefill_tokens_per_s ← decayed (prefill tokens / step seconds)
    decode-only step           →  decode_step_s        ← decayed (step seconds), decode_batch ← (sequences)

A step that mixes prefill and decode counts as prefill (its decode rows ride along), so the prefill rate is
a lower bound. `StepCost` fits every step to a line instead, so a router can price a step of any mix:

    step seconds ≈ fixed_s + prefill_token_s · prefill tokens + decode_row_s · decode rows

The first step of a kind runs cold (lazy initialisation, first-touch allocations: several times slower than the
next on a fresh node), so its figure holds only until the second step of that kind replaces it; from then on
the newest step weighs ``max(DECAY, 1/n)`` (a plain mean of the first n warm steps, then a decayed one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

DECAY = 0.1  # weight of the newest step in each average
STEP_COST_DECAY = 0.05  # ... in `StepCost`'s sums: three coefficients want a longer memory (~20 steps)
MIN_PREFILL_TOKENS = 16  # a step computing fewer prompt tokens says little about the prefill rate


@dataclass(slots=True)
class StepRates:
    """Step figures (module docstring); 0.0 until the first step of the kind. Written by the engine's thread only
    (plain floats: any thread may read a snapshot)."""

    prefill_tokens_per_s: float = 0.0
    decode_step_s: float = 0.0
    decode_batch: float = 0.0
    cost: StepCost = field(default_factory=lambda: StepCost())
    _prefill_steps: int = 0  # steps folded in, of each kind
    _decode_steps: int = 0

    def observe(self, *, prefill_tokens: int, decode_seqs: int, seconds: float) -> None:
        """Fold in one step that computed ``prefill_tokens`` prompt tokens and ``decode_seqs`` decode rows in
        ``seconds`` (wall time of the forward and sampling)."""
        if seconds <= 0:
            return
        if prefill_tokens > 0 or decode_seqs > 0:
            self.cost.observe(prefill_tokens, decode_seqs, seconds)
        if prefill_tokens >= MIN_PREFILL_TOKENS:
            self._prefill_steps += 1
            self.prefill_tokens_per_s = _folded(self.prefill_tokens_per_s, prefill_tokens / seconds,
                                                self._prefill_steps)
        elif prefill_tokens == 0 and decode_seqs > 0:
            self._decode_steps += 1
            self.decode_step_s = _folded(self.decode_step_s, seconds, self._decode_steps)
            self.decode_batch = _folded(self.decode_batch, float(decode_seqs), self._decode_steps)


def _folded(average: float, sample: float, n: int) -> float:
    """The average after the ``n``-th sample: the first two replace it (the first ran cold), then the newest
    weighs ``max(DECAY, 1 / (n - 1))``."""
    if n <= 2:
        return sample
    weight = max(DECAY, 1.0 / (n - 1))
    return (1 - weight) * average + weight * sample


# `StepCost`'s candidate supports, tried in this order; on an equal residual the earlier wins (one sample of a
# prefill step is a rate through the origin, as `StepRates` had it, not a fixed cost)
_SUPPORTS = ((0, 1, 2), (1, 2), (0, 1), (0, 2), (1,), (2,), (0,))


@dataclass(slots=True)
class StepCost:
    """``step seconds ≈ fixed_s + prefill_token_s · prefill tokens + decode_row_s · decode rows``: least squares
    over decayed sums (the newest step weighs `STEP_COST_DECAY` against those before), every coefficient ≥ 0
    (non-negative least squares, exact: the best of the unconstrained fits over each subset of the three terms
    that comes out non-negative). The first step ran cold and stands alone until the second replaces it. A term
    the steps never vary stays 0.0 (a prefill node that never decodes: ``decode_row_s`` 0.0; with one kind of
    step seen, a rate through the origin). ``samples`` 0: nothing fitted (all 0.0).

    `observe` is called by one thread; any thread may read `coefficients` (fitted from a consistent snapshot of
    the sums).
    """

    samples: int = 0
    _sums: list[float] = field(default_factory=lambda: [0.0] * 10)  # w; Σ of 1, p, d, p², pd, d², y, py, dy, y²
    _fit_of: list[float] | None = None  # the sums `_fit` was computed from ...
    _fitted: tuple[float, float, float] = (0.0, 0.0, 0.0)  # ... and its coefficients

    @property
    def coefficients(self) -> tuple[float, float, float]:
        """``(fixed_s, prefill_token_s, decode_row_s)``, fitted on first read after a step (the engine's step
        pays ~1 µs for its sums, not the ~0.15 ms of a fit)."""
        sums = self._sums  # one list per step, never changed in place: a consistent snapshot
        if self._fit_of is not sums:
            self._fitted, self._fit_of = _fit(sums), sums
        return self._fitted

    def observe(self, prefill_tokens: int, decode_rows: int, seconds: float) -> None:
        """Fold in one step of ``prefill_tokens`` prompt tokens and ``decode_rows`` decode rows that took
        ``seconds`` (> 0; others are ignored)."""
        if seconds <= 0 or prefill_tokens < 0 or decode_rows < 0:
            return
        keep = 1 - STEP_COST_DECAY if self.samples >= 2 else 0.0  # the second sample drops the cold first
        self.samples += 1
        p, d, y = float(prefill_tokens), float(decode_rows), seconds
        terms = (1.0, p, d, p * p, p * d, d * d, y, p * y, d * y, y * y)
        self._sums = [keep * s + t for s, t in zip(self._sums, terms, strict=True)]


def _fit(sums: list[float]) -> tuple[float, float, float]:
    """Non-negative least squares of ``y`` on ``(1, p, d)`` from `StepCost`'s sums (its docstring)."""
    w, sp, sd, spp, spd, sdd, sy, spy, sdy, syy = sums
    gram = ((w, sp, sd), (sp, spp, spd), (sd, spd, sdd))
    rhs = (sy, spy, sdy)
    best, best_residual = (0.0, 0.0, 0.0), syy
    for support in _SUPPORTS:
        beta = _solve([[gram[i][j] for j in support] for i in support], [rhs[i] for i in support])
        if beta is None or min(beta) < 0:
            continue
        residual = syy - sum(b * rhs[i] for b, i in zip(beta, support, strict=True))  # at the least-squares β
        if residual < best_residual - 1e-9 * syy:
            full = [0.0, 0.0, 0.0]
            for b, i in zip(beta, support, strict=True):
                full[i] = b
            best, best_residual = (full[0], full[1], full[2]), residual
    return best


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """``x`` with ``a · x = b`` for a symmetric positive semi-definite Gram matrix ``a``; None when ``a`` is
    singular once scaled to unit diagonal (a term the samples never varied, or two that always varied together)."""
    gram, rhs = np.array(a), np.array(b)
    diag = np.sqrt(np.diag(gram))
    if diag.min() <= 0 or np.linalg.cond(gram / np.outer(diag, diag)) > 1e9:
        return None
    return np.linalg.solve(gram, rhs).tolist()


@dataclass(slots=True)
class DecayedLine:
    """``y ≈ intercept + slope · x``, fitted by least squares over decayed sums (each sample weighs ``DECAY``
    against the ones before it). The first sample is taken to have run cold (a fresh connection, lazy
    initialisation): it stands alone until the second sample replaces it. Until samples at two different ``x``
    are seen, or when the fit is not physical (slope ≤ 0, or an intercept below 0), it falls back to
    ``fallback``: ``"ratio"``
    (through the origin: ``slope = mean y / mean x``) or ``"offset"`` (``slope = 1``, ``intercept = mean y -
    mean x``). ``samples`` 0: nothing fitted (both 0.0). Not thread-safe; readers may take a snapshot.
    """

    fallback: str = "ratio"
    samples: int = 0
    intercept: float = 0.0
    slope: float = 0.0
    _w: float = 0.0  # decayed sums: weight, x, y, x², x·y
    _x: float = 0.0
    _y: float = 0.0
    _xx: float = 0.0
    _xy: float = 0.0

    def observe(self, x: float, y: float) -> None:
        keep = 1 - DECAY if self.samples >= 2 else 0.0  # the second sample drops the cold first
        self.samples += 1
        self._w = keep * self._w + 1.0
        self._x = keep * self._x + x
        self._y = keep * self._y + y
        self._xx = keep * self._xx + x * x
        self._xy = keep * self._xy + x * y
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mean_x * mean_x
        slope = (self._xy / self._w - mean_x * mean_y) / var if var > 1e-9 * max(mean_x * mean_x, 1e-30) else 0.0
        intercept = mean_y - slope * mean_x
        if slope > 0 and intercept >= 0:
            self.slope, self.intercept = slope, intercept
        elif self.fallback == "ratio":
            self.slope, self.intercept = (mean_y / mean_x if mean_x > 0 else 0.0), 0.0
        else:
            self.slope, self.intercept = 1.0, mean_y - mean_x

    def predict(self, x: float) -> float:
        return self.intercept + self.slope * x


@dataclass(slots=True)
class PullRates:
    """How long this node takes to pull a request's KV from a peer, fitted to its own pulls:

        seconds ≈ fixed_s + bytes / bytes_per_s            (`DecayedLine`, through the origin until it can fit)

    0.0 for both until the first pull. Written on the node's event loop only; any thread may read a snapshot.
    """

    line: DecayedLine = field(default_factory=DecayedLine)

    def observe(self, nbytes: int, seconds: float) -> None:
        """Fold in one pull that moved ``nbytes`` (> 0) in ``seconds`` (> 0; wall time from the node's first
        call to the owner to the last block landed). Others are ignored."""
        if nbytes > 0 and seconds > 0:
            self.line.observe(float(nbytes), seconds)

    @property
    def bytes_per_s(self) -> float:
        return 1.0 / self.line.slope if self.line.slope > 0 else 0.0

    @property
    def fixed_s(self) -> float:
        return self.line.intercept

    def predict_s(self, nbytes: int) -> float:
        """Predicted seconds to pull ``nbytes``; 0.0 before any pull (nothing measured: assume free)."""
        if nbytes <= 0 or self.line.slope <= 0:
            return 0.0
        return self.line.predict(nbytes)
