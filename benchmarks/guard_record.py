"""The regression guard's figures, its record of the last figures per CPU in ``docs/benchmarks.md``, and the
comparison of a fresh run with that record (`benchmarks.guard_bench` measures; this module only reads,
compares and rewrites text).

**Figures** (`FIGURES`) are kvrelay / vLLM ratios measured in one run, each the median of its rounds' ratios.

**The record** is the first fenced ``json`` block under the heading `RECORDS_HEADING`: one object keyed by
`model.cpu_identity.CpuIdentity.key`, each value a `GuardRecord`::

    ### Regression guard records
    ```json
    {
      "AMD EPYC (family 25, model 17; avx512_bf16)": {
        "commit": "abc1234", "date": "2026-12-07", "model": "smollm2-135m-instruct",
        "ratios": {"client_output_throughput": 0.97, ...},
        "spreads": {"client_output_throughput": 0.04, ...}
      }
    }
    ```

**Noise** — a figure has regressed when it moved the wrong way (a throughput ratio down, a TPOT ratio up) by more
than its margin, ``max(NOISE_FLOOR_FRAC, (fresh spread + recorded spread) / 2)`` of the recorded value, where a
spread is ``(max - min) / median`` of one run's per-round ratios. Each of the two medians may sit about half its
rounds' range from where a longer run would put it, so they may differ by the sum of those halves with nothing
changed; hence the spreads. The floor covers what one run's few rounds do not show: ratios measured in
alternation moved between whole runs by up to 10% on 2026-12-07 (two runs of the same tree, 1.52 and 1.70 for the
aggregated burst) and by 1-12% in the README's repeated runs (aggregated 1.92-2.02x, 1P1D 1.71-1.92x). 15% sits
above that and well below what the guard is for: issue 33's steps were 20-40%, and a run beside another job
holding a core read kvrelay 85% down.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

RECORDS_HEADING = "### Regression guard records"
NOISE_FLOOR_FRAC = 0.15


@dataclass(frozen=True, slots=True)
class Figure:
    """kvrelay's ``field`` over vLLM's, from the ``workload`` runs (``client``: ``vllm bench serve``; ``burst``:
    the shared-prefix burst) against kvrelay's ``layout`` (``aggregated`` or ``1p1d``)."""

    name: str
    label: str
    higher_is_better: bool
    workload: str
    layout: str
    field: str


FIGURES: tuple[Figure, ...] = (
    Figure("client_output_throughput", "vllm bench serve c=16, out tok/s", True, "client", "aggregated",
           "output_throughput"),
    Figure("client_mean_tpot", "vllm bench serve c=16, mean TPOT", False, "client", "aggregated", "mean_tpot_ms"),
    Figure("burst_output_throughput_aggregated", "burst, aggregated, out tok/s", True, "burst", "aggregated",
           "output_throughput"),
    Figure("burst_output_throughput_1p1d", "burst, 1P1D, out tok/s", True, "burst", "1p1d", "output_throughput"),
)


@dataclass(frozen=True, slots=True)
class RatioSummary:
    """One figure of one run: its per-round kvrelay / vLLM ratios (at least one) and their median."""

    rounds: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.rounds)

    @property
    def spread(self) -> float:
        """``(max - min) / median`` of the rounds; 0 for one round (and for a median of 0)."""
        median = self.median
        return (max(self.rounds) - min(self.rounds)) / median if median > 0 else 0.0


def summarize_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, RatioSummary]:
    """``figure name → RatioSummary`` from a guard's run rows (``layout``, ``round``, ``workload``, ``server``:
    ``kvrelay`` or ``vllm``, and the figures' fields), each round's ratio taken between the kvrelay and vLLM rows
    of the same layout, round and workload. A figure none of whose rounds has both rows (or a non-zero vLLM
    value) is left out."""
    out = {}
    for figure in FIGURES:
        mine = [r for r in runs if r["workload"] == figure.workload and r["layout"] == figure.layout]
        server_round_to_value = {(r["server"], r["round"]): r.get(figure.field) for r in mine}
        ratios = []
        for rnd in sorted({r["round"] for r in mine}):
            ours, theirs = server_round_to_value.get(("kvrelay", rnd)), server_round_to_value.get(("vllm", rnd))
            if ours is not None and theirs:
                ratios.append(ours / theirs)
        if ratios:
            out[figure.name] = RatioSummary(tuple(ratios))
    return out


@dataclass(frozen=True, slots=True)
class GuardRecord:
    """The figures recorded for one CPU: each figure's median ratio and spread (`RatioSummary`)."""

    commit: str
    date: str
    model: str
    ratios: dict[str, float] = field(default_factory=dict)
    spreads: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_summaries(cls, summaries: Mapping[str, RatioSummary], *, commit: str, date: str,
                       model: str) -> GuardRecord:
        """Medians and spreads rounded to 3 decimals (the record is read by people too)."""
        return cls(commit, date, model, ratios={n: round(s.median, 3) for n, s in summaries.items()},
                   spreads={n: round(s.spread, 3) for n, s in summaries.items()})

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> GuardRecord:
        return cls(str(obj["commit"]), str(obj["date"]), str(obj["model"]),
                   ratios={k: float(v) for k, v in obj["ratios"].items()},
                   spreads={k: float(v) for k, v in obj.get("spreads", {}).items()})


@dataclass(frozen=True, slots=True)
class Verdict:
    """A fresh figure against its record; ``recorded`` is None where the record lacks it (never a regression)."""

    figure: Figure
    fresh: RatioSummary
    recorded: float | None
    margin_frac: float

    @property
    def worse_frac(self) -> float | None:
        """How much worse than recorded, as a fraction of it (negative: better)."""
        if self.recorded is None:
            return None
        change = self.fresh.median / self.recorded - 1.0
        return -change if self.figure.higher_is_better else change

    @property
    def regressed(self) -> bool:
        worse = self.worse_frac
        return worse is not None and worse > self.margin_frac


def judge(fresh: Mapping[str, RatioSummary], record: GuardRecord | None) -> list[Verdict]:
    """A `Verdict` for each figure of `FIGURES` in ``fresh`` (in `FIGURES`' order), against ``record`` (None:
    no record for this CPU), each judged with the margin of the module doc."""
    out = []
    for figure in (f for f in FIGURES if f.name in fresh):
        summary = fresh[figure.name]
        recorded = None if record is None else record.ratios.get(figure.name)
        recorded_spread = 0.0 if record is None else record.spreads.get(figure.name, 0.0)
        margin = max(NOISE_FLOOR_FRAC, (summary.spread + recorded_spread) / 2)
        out.append(Verdict(figure, summary, recorded, margin))
    return out


def _block_span(lines: Sequence[str]) -> tuple[int, int]:
    """Indexes of the opening and closing fence of the records block.

    Raises:
        ValueError: no `RECORDS_HEADING` line, or no fenced ``json`` block (closed) after it.
    """
    try:
        heading = next(i for i, line in enumerate(lines) if line.rstrip() == RECORDS_HEADING)
    except StopIteration:
        raise ValueError(f"no {RECORDS_HEADING!r} heading; add it with a ```json block holding {{}} "
                         "under it") from None
    opening = next((i for i in range(heading + 1, len(lines)) if lines[i].strip() == "```json"), None)
    closing = None if opening is None else next(
        (i for i in range(opening + 1, len(lines)) if lines[i].strip() == "```"), None)
    if opening is None or closing is None:
        raise ValueError(f"no closed ```json block under {RECORDS_HEADING!r}; put one holding {{}} there")
    return opening, closing


def read_records(markdown: str) -> dict[str, GuardRecord]:
    """``cpu key → GuardRecord`` from the records block of ``markdown``.

    Raises:
        ValueError: no block (see `_block_span`), or its text is not a JSON object of records (naming what).
    """
    lines = markdown.splitlines()
    opening, closing = _block_span(lines)
    try:
        obj = json.loads("\n".join(lines[opening + 1 : closing]) or "{}")
        return {str(k): GuardRecord.from_json(v) for k, v in obj.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"the block under {RECORDS_HEADING!r} is not a JSON object of guard records "
                         f"(commit, date, model, ratios, spreads): {exc!r}") from None


def write_record(markdown: str, cpu_key: str, record: GuardRecord) -> str:
    """``markdown`` with ``record`` set for ``cpu_key`` in its records block (other CPUs' records kept, keys
    sorted); every line outside the block is left as it was, line endings included.

    Raises:
        ValueError: as `read_records`.
    """
    cpu_to_record = {**read_records(markdown), cpu_key: record}
    text = json.dumps({k: asdict(v) for k, v in sorted(cpu_to_record.items())}, indent=2)
    lines = markdown.splitlines(keepends=True)
    opening, closing = _block_span([line.rstrip("\r\n") for line in lines])
    newline = "\r\n" if lines[opening].endswith("\r\n") else "\n"
    body = [line + newline for line in text.splitlines()]
    return "".join(lines[: opening + 1] + body + lines[closing:])
