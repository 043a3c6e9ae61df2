"""The goodput bench's per-request rows and disaggregated hand-off (`benchmarks.goodput_bench`): what each
request of a point took, as the client timed it and the router's ``kvrelay.timings`` answer field reports it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from kvrelay.benchmarks.serve_client import RequestRecord
from kvrelay.benchmarks.serve_metrics import request_tpot_s


def request_rows(records: Sequence[RequestRecord]) -> list[dict[str, Any]]:
    """Per request: the server's id (``id``, "" if it sent none), ``prompt_tokens``, ``ttft_ms`` and ``tpot_ms``
    (`request_tpot_s`; both None for a failed request), ``ok`` (it succeeded), and from the router's ``kvrelay``
    answer field the ``plan`` ("" if none), ``kv_pull_ms`` (None if it reported none) and every stage timing it
    reported (``stages_ms``: `router.request_trace`'s names without ``_s``, in ms; empty if none), so a miss can be
    put down to a stage (the router's queue, a node's queue, its compute, the publish)."""
    rows = []
    for r in records:
        timings = r.server.get("timings") or {}
        pull = timings.get("kv_pull_s")
        stages = {name.removesuffix("_s"): round(float(v) * 1e3, 1) for name, v in timings.items()
                  if isinstance(v, (int, float)) and not isinstance(v, bool)}
        rows.append({"id": r.response_id, "prompt_tokens": r.prompt_len,
                     "ttft_ms": round(r.ttft_s * 1e3, 1) if r.success else None,
                     "tpot_ms": round(request_tpot_s(r) * 1e3, 2) if r.success else None, "ok": r.success,
                     "plan": str(r.server.get("plan") or ""),
                     "kv_pull_ms": round(float(pull) * 1e3, 1) if isinstance(pull, (int, float)) else None,
                     "stages_ms": stages})
    return rows


def handoff(records: Sequence[RequestRecord]) -> dict[str, float | int]:
    """The hand-off of the successful disaggregated requests (plan ``disaggregated`` in the router's answer field)
    with two tokens or more: how many (``requests``), and the median and p90 in ms of their KV pull (``kv_pull_ms_*``)
    and of the gap between their first and second token (``second_token_ms_*``: the first comes from the prefill
    node, the second from the decode node once it pulled). Empty: none."""
    ok = [r for r in records if r.success and r.server.get("plan") == "disaggregated" and len(r.chunk_times_s) > 1]
    if not ok:
        return {}
    pulls = [float((r.server.get("timings") or {}).get("kv_pull_s", 0.0)) for r in ok]
    gaps = [r.chunk_times_s[1] - r.chunk_times_s[0] for r in ok]
    out: dict[str, float | int] = {"requests": len(ok)}
    for name, values in (("kv_pull_ms", pulls), ("second_token_ms", gaps)):
        out[f"{name}_median"] = round(float(np.percentile(values, 50)) * 1e3, 1)
        out[f"{name}_p90"] = round(float(np.percentile(values, 90)) * 1e3, 1)
    return out
