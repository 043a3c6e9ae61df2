"""`kvrelay bench structured`: TPOT with a JSON schema over the same requests unconstrained, kvrelay and vLLM's CPU
build in one run; and what compiling a schema costs.

Issue 32's measurement. ``--concurrency`` (16) chat requests at once on the real model, greedy, streamed; each asks
for one of `NAME_TO_SCHEMA`'s eight schemas (nested objects, enums, arrays, required fields, strings with
``maxLength``, a few ``pattern``s), two prompts per schema, the schema in the prompt as a user would put it. The
constraint is OpenAI's ``response_format: {"type": "json_schema", ...}``, which both servers read.

Fairness of lengths: TPOT (``(E2EL - TTFT) / (output tokens - 1)`` per request, as ``vllm bench serve``;
`benchmarks.serve_metrics.request_tpot_s`) depends on how long the batch decodes, so each unconstrained request
decodes exactly as many tokens as its constrained twin did in the constrained pass just before it: ``max_tokens``
set to that count with ``ignore_eos: true``. Constrained requests run with ``ignore_eos`` off and stop where the
grammar ends (``--max-tokens`` only bounds a runaway; those are counted as ``truncated``). Paired passes then
decode the same tokens per request in the same batch shape; what differs is the grammar (its bitmask each step,
the matcher's advance).

Per server (kvrelay: ``kvrelay up`` of the shipped config, 1 prefill + 1 decode node, ``router.disaggregation``
``--disaggregation``, a fresh disk tier; then vLLM through ``--peer-script``, one server at a time), in order:

    1. warm-up       every prompt once unconstrained (2 tokens), then one ``json_object`` request: the prompts
                     are in the prefix cache for every measured pass, and the vocabulary's one-time grammar
                     setup is paid (its TTFT is reported as ``first_structured_ttft_ms``)
    2. probes        per schema (``--probes``), a lone 1-token request with a copy of the schema never sent
                     before (another ``title``: the same grammar, a new cache key), then the same again:
                     TTFT cold - warm is what compiling costs a user's first request
    3. cold pass     the requests at once, every schema new to the server
    4. --repeats x   a warm constrained pass (every schema compiled), then the unconstrained pass matched to it

and reports per pass TTFT, TPOT (mean / median / p90, ms), output tokens, and for constrained passes the share of
outputs that parse and validate (`jsonschema`); the ratios constrained / unconstrained of mean and median TPOT (warm
passes pooled; the cold pass too), side by side for both servers (issue 32's target: at most 1.10 for kvrelay).
Schema compile time is measured in this process first (no server running): `engine.grammar.Grammars.compile` of
each schema as the router builds it, on a fresh `Grammars` per repeat, after the vocabulary's setup.

vLLM runs with its defaults (what a user runs): its xgrammar backend allows any whitespace in JSON, so its outputs
are longer than kvrelay's (one space after each ``,`` and ``:``; each server's ratio compares it with itself);
``--vllm-args '--structured-outputs-config.disable_any_whitespace true'`` fixes its whitespace too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from kvrelay.benchmarks.common import emit, machine_label
from kvrelay.benchmarks.peer import DEFAULT_PEER_SCRIPT
from kvrelay.benchmarks.serve_client import RequestRecord, RequestSpec, feed_sse_line
from kvrelay.benchmarks.serve_metrics import request_tpot_s

TARGET_TPOT_RATIO = 1.10  # issue 32: constrained / unconstrained mean TPOT on kvrelay


def _text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def _int(lo: int, hi: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


def _enum(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def _object(required: Sequence[str], **properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(required), "additionalProperties": False}


def _array(items: dict[str, Any], *, min_items: int = 0, max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": min_items, "maxItems": max_items}


# Every string, array and integer is bounded: a 135M model offered an unbounded string may fill its whole budget.
NAME_TO_SCHEMA: dict[str, dict[str, Any]] = {
    "person": _object(["name", "age", "roles"], name=_text(32), age=_int(0, 120), email=_text(40),
                      roles=_array(_enum("admin", "editor", "viewer"), min_items=1, max_items=3)),
    "product": _object(["sku", "title", "price_cents", "in_stock"],
                       sku={"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"}, title=_text(48),
                       price_cents=_int(0, 1_000_000), in_stock={"type": "boolean"},
                       tags=_array(_text(16), max_items=4)),
    "address": _object(["name", "address"], name=_text(40), phone=_text(20),
                       address=_object(["street", "city", "country", "postal_code"], street=_text(48),
                                       city=_text(32), country=_enum("US", "GB", "FR", "DE", "PT", "JP"),
                                       postal_code={"type": "string", "pattern": "^[0-9]{5}$"})),
    "event": _object(["title", "date", "venue"], title=_text(48),
                     date={"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
                     venue=_object(["name", "capacity"], name=_text(32), capacity=_int(1, 100_000)),
                     attendees=_array(_object(["name", "rsvp"], name=_text(24), rsvp=_enum("yes", "no", "maybe")),
                                      max_items=4)),
    "recipe": _object(["name", "servings", "difficulty", "ingredients", "steps"], name=_text(40),
                      servings=_int(1, 12), difficulty=_enum("easy", "medium", "hard"),
                      ingredients=_array(_object(["item", "quantity"], item=_text(24), quantity=_text(12)),
                                         min_items=1, max_items=5),
                      steps=_array(_text(60), min_items=1, max_items=4)),
    "weather": _object(["city", "temperature_c", "condition", "wind"], city=_text(32), temperature_c=_int(-50, 60),
                       condition=_enum("sunny", "cloudy", "rain", "snow", "storm"),
                       wind=_object(["speed_kmh", "direction"], speed_kmh=_int(0, 300),
                                    direction=_enum("N", "NE", "E", "SE", "S", "SW", "W", "NW")),
                       forecast=_array(_object(["day", "high_c", "low_c"],
                                               day=_enum("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun"),
                                               high_c=_int(-50, 60), low_c=_int(-50, 60)), max_items=3)),
    "ticket": _object(["title", "severity", "component", "assignee"], title=_text(60),
                      severity=_enum("low", "medium", "high", "critical"),
                      component=_enum("api", "ui", "database", "auth"),
                      assignee={"anyOf": [_text(24), {"type": "null"}]},
                      steps_to_reproduce=_array(_text(48), max_items=3)),
    "book": _object(["title", "author", "year", "genres", "available"], title=_text(48),
                    author=_object(["first", "last"], first=_text(20), last=_text(20)), year=_int(1450, 2025),
                    genres=_array(_enum("fiction", "mystery", "science", "history", "poetry", "fantasy"),
                                  min_items=1, max_items=3),
                    rating=_int(1, 5), available={"type": "boolean"}),
}
NAME_TO_SUBJECTS: dict[str, tuple[str, str]] = {
    "person": ("a fictional software engineer who lives in Lisbon",
               "a retired school teacher who volunteers at a library"),
    "product": ("a stainless steel water bottle sold by an outdoor store", "a pair of noise-cancelling headphones"),
    "address": ("the head office of a small bakery in Porto", "a dentist's practice in Munich"),
    "event": ("a community chess tournament next spring", "a company's summer picnic in a park"),
    "recipe": ("a simple tomato soup", "pancakes for a weekend breakfast"),
    "weather": ("a rainy autumn day in Dublin", "a hot summer afternoon in Madrid"),
    "ticket": ("a login page that crashes when the password is empty",
               "a database query that times out on large reports"),
    "book": ("a classic mystery novel", "a popular science book about the ocean"),
}


@dataclass(frozen=True, slots=True)
class Task:
    """One request of every pass: which schema it is constrained by and its user message."""

    schema_name: str
    prompt: str


def make_tasks(num_requests: int) -> list[Task]:
    """``num_requests`` tasks: request ``i`` uses schema ``i % 8`` (in `NAME_TO_SCHEMA`'s order) and that schema's
    subject ``(i // 8) % 2``; 16 requests use every schema with both subjects once."""
    names = list(NAME_TO_SCHEMA)
    tasks = []
    for i in range(num_requests):
        name = names[i % len(names)]
        subject = NAME_TO_SUBJECTS[name][(i // len(names)) % 2]
        schema = json.dumps(NAME_TO_SCHEMA[name], separators=(",", ":"))
        tasks.append(Task(name, f"Describe {subject}. Reply with only a JSON object that follows this JSON "
                                f"schema: {schema}"))
    return tasks


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``schema`` (strict: the schemas name every property anyway)."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def probe_schema(schema: dict[str, Any], tag: str) -> dict[str, Any]:
    """``schema`` with ``title`` set to ``probe-{tag}``: the same grammar under a cache key never seen before."""
    return {**schema, "title": f"probe-{tag}"}


def chat_body(model: str, prompt: str, *, max_tokens: int, schema: tuple[str, dict[str, Any]] | None) -> dict[str, Any]:
    """A streaming greedy chat request. ``schema`` ``(name, schema)``: constrained, ``ignore_eos`` off (the grammar
    ends it); None: unconstrained with ``ignore_eos`` on, so it decodes exactly ``max_tokens``."""
    body: dict[str, Any] = {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
        "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": schema is None}
    if schema is not None:
        body["response_format"] = response_format(*schema)
    return body


def is_valid(text: str, schema: dict[str, Any]) -> bool:
    """``text`` is JSON and an instance of ``schema`` (JSON Schema draft 2020-12, formats not checked)."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def matched_max_tokens(records: Sequence[RequestRecord], *, fallback: int) -> list[int]:
    """Per request, the output tokens its constrained twin produced (at least 1); ``fallback`` where it failed."""
    return [max(1, r.num_output_tokens) if r.success else fallback for r in records]


# ------------------------------------------------------------------ client
async def send_chat(session: aiohttp.ClientSession, url: str, body: dict[str, Any], *, timeout_s: float) -> \
        RequestRecord:
    """POST one streaming chat completion to ``url`` (server root) and read it to the end; never raises for server
    or network failures (``success=False``, ``error`` set). Times as `benchmarks.serve_client` defines them."""
    record = RequestRecord(RequestSpec((), int(body["max_tokens"])))
    record.send_time_s = time.perf_counter()
    try:
        async with session.post(url + "/v1/chat/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return record
            done = False
            async for raw in resp.content:
                done = feed_sse_line(record, raw.decode("utf-8", "replace"), time.perf_counter()) or done
            record.success = done and bool(record.chunk_times_s)
            if not record.success:
                record.error = "stream ended without a token" if not record.chunk_times_s else "stream ended early"
    except asyncio.TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
    except (aiohttp.ClientError, ValueError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:500]
    return record


async def _all_at_once(url: str, bodies: Sequence[dict[str, Any]], timeout_s: float) -> list[RequestRecord]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        return list(await asyncio.gather(*(send_chat(session, url, b, timeout_s=timeout_s) for b in bodies)))


def send_all(url: str, bodies: Sequence[dict[str, Any]], *, timeout_s: float) -> list[RequestRecord]:
    """Send ``bodies`` at once and wait for every one; records in ``bodies``' order."""
    return asyncio.run(_all_at_once(url, bodies, timeout_s))


# ------------------------------------------------------------------ statistics
@dataclass(frozen=True, slots=True)
class PassStats:
    """One pass, or several pooled. Times in ms over the successful requests (TPOT over those with more than one
    output token); None where there is none. ``truncated`` and ``valid_frac`` only for constrained passes:
    requests that stopped at ``max_tokens`` (their JSON is cut off), and the share of requests sent (failed
    ones count invalid) whose output parses and validates."""

    requests: int
    failed: int
    mean_ttft_ms: float | None
    median_ttft_ms: float | None
    mean_tpot_ms: float | None
    median_tpot_ms: float | None
    p90_tpot_ms: float | None
    mean_output_tokens: float | None
    truncated: int | None = None
    valid_frac: float | None = None


def _ms(values_s: Sequence[float], how: str) -> float | None:
    if not values_s:
        return None
    if how == "mean":
        return statistics.fmean(values_s) * 1000.0
    if how == "median":
        return statistics.median(values_s) * 1000.0
    return statistics.quantiles(values_s, n=10, method="inclusive")[-1] * 1000.0 if len(values_s) > 1 \
        else values_s[0] * 1000.0


def pass_stats(records: Sequence[RequestRecord], schemas: Sequence[dict[str, Any]] | None = None) -> PassStats:
    """`PassStats` of ``records``; ``schemas`` (one per record) makes it a constrained pass (validity, truncation).

    Raises:
        ValueError: ``schemas`` given with another length than ``records``.
    """
    if schemas is not None and len(schemas) != len(records):
        raise ValueError(f"{len(schemas)} schemas for {len(records)} records; give one per record")
    ok = [r for r in records if r.success]
    ttfts = [r.ttft_s for r in ok]
    tpots = [request_tpot_s(r) for r in ok if r.num_output_tokens > 1]
    tokens = [r.num_output_tokens for r in ok]
    truncated = valid = None
    if schemas is not None:
        truncated = sum(r.num_output_tokens >= r.spec.max_tokens for r in ok)
        good = sum(r.success and is_valid(r.generated_text, s) for r, s in zip(records, schemas, strict=True))
        valid = good / len(records) if records else None
    return PassStats(len(records), len(records) - len(ok), _ms(ttfts, "mean"), _ms(ttfts, "median"),
                     _ms(tpots, "mean"), _ms(tpots, "median"), _ms(tpots, "p90"),
                     statistics.fmean(tokens) if tokens else None, truncated, valid)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def tpot_ratios(constrained: PassStats, unconstrained: PassStats) -> dict[str, float | None]:
    """Constrained over unconstrained ``mean`` and ``median`` TPOT; None where either is missing or zero."""
    return {"mean": _ratio(constrained.mean_tpot_ms, unconstrained.mean_tpot_ms),
            "median": _ratio(constrained.median_tpot_ms, unconstrained.median_tpot_ms)}


def errors_of(records: Sequence[RequestRecord], *, limit: int = 3) -> list[str]:
    """The first ``limit`` distinct errors of ``records``, in order."""
    return list(dict.fromkeys(r.error for r in records if r.error))[:limit]


# ------------------------------------------------------------------ compile time
@dataclass(frozen=True, slots=True)
class CompileTimes:
    """``setup_ms``: per repeat, a fresh `Grammars`' first compile (the vocabulary's ``TokenizerInfo`` and the
    compiler, with any-JSON-object's grammar); ``schema_to_ms``: per schema, its compile per repeat after that."""

    setup_ms: list[float]
    schema_to_ms: dict[str, list[float]]

    def summary(self) -> dict[str, Any]:
        every = [ms for times in self.schema_to_ms.values() for ms in times]
        return {"repeats": len(self.setup_ms), "setup_ms": statistics.fmean(self.setup_ms),
                "mean_ms": statistics.fmean(every), "max_ms": max(every),
                "per_schema": {name: {"mean_ms": statistics.fmean(t), "max_ms": max(t)}
                               for name, t in self.schema_to_ms.items()}}


def compile_times(model_dir: str, *, repeats: int) -> CompileTimes:
    """Time `engine.grammar.Grammars.compile` for every schema of `NAME_TO_SCHEMA`, built as the router builds
    ``response_format`` (`router.structured_api.structured_from_body`), on ``repeats`` fresh `Grammars` of the
    model's vocabulary (the compile cache is per instance).

    Raises:
        engine.grammar.GrammarError: a schema does not compile, or the model has no ``tokenizer.json``.
    """
    from kvrelay.engine.grammar import Grammars
    from kvrelay.model.config import read_model_config
    from kvrelay.model.structured import StructuredOutput
    from kvrelay.router.structured_api import structured_from_body

    cfg = read_model_config(model_dir)
    outs = {name: structured_from_body({"response_format": response_format(name, schema)})[0]
            for name, schema in NAME_TO_SCHEMA.items()}
    setup: list[float] = []
    schema_to_ms: dict[str, list[float]] = {name: [] for name in outs}
    for _ in range(repeats):
        grammars = Grammars(model_dir, cfg.vocab_size, cfg.eos_token_ids)
        t0 = time.perf_counter()
        grammars.compile(StructuredOutput("json_object"))
        setup.append((time.perf_counter() - t0) * 1000.0)
        for name, out in outs.items():
            assert out is not None
            t0 = time.perf_counter()
            grammars.compile(out)
            schema_to_ms[name].append((time.perf_counter() - t0) * 1000.0)
    return CompileTimes(setup, schema_to_ms)


# ------------------------------------------------------------------ one server
@dataclass(frozen=True, slots=True)
class Plan:
    """What every server is given: the tasks, ``max_tokens`` of a constrained request, warm/unconstrained pass
    pairs, schemas probed, and each request's timeout."""

    tasks: list[Task]
    max_tokens: int
    repeats: int
    probes: int
    timeout_s: float


def measure_server(label: str, url: str, model: str, plan: Plan) -> dict[str, Any]:
    """Steps 1-4 of the module docstring against one running server; the per-server part of the report."""
    tasks, timeout = plan.tasks, plan.timeout_s
    schemas = [NAME_TO_SCHEMA[t.schema_name] for t in tasks]

    def constrained(max_tokens: int) -> list[dict[str, Any]]:
        return [chat_body(model, t.prompt, max_tokens=max_tokens, schema=(t.schema_name, s))
                for t, s in zip(tasks, schemas)]

    def log(what: str, stats: PassStats) -> None:
        valid = "" if stats.valid_frac is None else f"  valid {stats.valid_frac:.2f}  truncated {stats.truncated}"
        print(f"structured: {label:7s} {what:13s} TPOT mean {_fmt(stats.mean_tpot_ms)} median "
              f"{_fmt(stats.median_tpot_ms)} ms  TTFT mean {_fmt(stats.mean_ttft_ms)} ms  tokens "
              f"{_fmt(stats.mean_output_tokens)}  failed {stats.failed}{valid}", file=sys.stderr, flush=True)

    send_all(url, [chat_body(model, t.prompt, max_tokens=2, schema=None) for t in tasks], timeout_s=timeout)
    first = send_all(url, [{**chat_body(model, tasks[0].prompt, max_tokens=2, schema=None), "ignore_eos": False,
                            "response_format": {"type": "json_object"}}], timeout_s=timeout)[0]
    probes = []
    for i, name in enumerate(list(NAME_TO_SCHEMA)[:plan.probes]):
        task = next(t for t in tasks if t.schema_name == name)
        body = chat_body(model, task.prompt, max_tokens=1, schema=(name, probe_schema(NAME_TO_SCHEMA[name], f"{i}")))
        cold = send_all(url, [body], timeout_s=timeout)[0]
        warm = send_all(url, [body], timeout_s=timeout)[0]  # the same schema again: compiled now
        probes.append({"schema": name, "cold_ttft_ms": cold.ttft_s * 1000.0 if cold.success else None,
                       "warm_ttft_ms": warm.ttft_s * 1000.0 if warm.success else None,
                       "errors": errors_of([cold, warm])})
    diffs = [p["cold_ttft_ms"] - p["warm_ttft_ms"] for p in probes
             if p["cold_ttft_ms"] is not None and p["warm_ttft_ms"] is not None]
    cold_records = send_all(url, constrained(plan.max_tokens), timeout_s=timeout)
    cold_stats = pass_stats(cold_records, schemas)
    log("cold", cold_stats)
    warm_records: list[RequestRecord] = []
    free_records: list[RequestRecord] = []
    for _ in range(plan.repeats):
        warm = send_all(url, constrained(plan.max_tokens), timeout_s=timeout)
        lengths = matched_max_tokens(warm, fallback=plan.max_tokens)
        free = send_all(url, [chat_body(model, t.prompt, max_tokens=n, schema=None) for t, n in zip(tasks, lengths)],
                        timeout_s=timeout)
        log("constrained", pass_stats(warm, schemas))
        log("unconstrained", pass_stats(free))
        warm_records += warm
        free_records += free
    warm_stats, free_stats = pass_stats(warm_records, schemas * plan.repeats), pass_stats(free_records)
    return {
        "first_structured_ttft_ms": first.ttft_s * 1000.0 if first.success else None,
        "probes": probes,
        "probe_ttft_cold_minus_warm_ms": {"mean": statistics.fmean(diffs), "max": max(diffs)} if diffs else None,
        "passes": {"cold": asdict(cold_stats), "constrained": asdict(warm_stats), "unconstrained": asdict(free_stats)},
        "tpot_ratio": tpot_ratios(warm_stats, free_stats),
        "cold_tpot_ratio": tpot_ratios(cold_stats, free_stats),
        "errors": {"first_structured": errors_of([first]), "cold": errors_of(cold_records),
                   "constrained": errors_of(warm_records), "unconstrained": errors_of(free_records)},
        "sample_output": next((r.generated_text[:300] for r in warm_records if r.success), None),
    }


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "–" if value is None else format(value, spec)


def markdown_table(servers: dict[str, dict[str, Any]]) -> str:
    """One row per server: warm constrained and unconstrained TPOT (mean / median ms), their ratios, the cold
    pass's mean ratio, the share of valid outputs (warm; cold), and the probes' mean TTFT cold - warm."""
    lines = ["| server | TPOT unconstrained (ms) | TPOT constrained (ms) | ratio mean | ratio median | cold ratio "
             "mean | valid (warm; cold) | first-request TTFT cold - warm (ms) |", "|---|---|---|---|---|---|---|---|"]
    for label, s in servers.items():
        free, warm, cold = s["passes"]["unconstrained"], s["passes"]["constrained"], s["passes"]["cold"]
        probe = s["probe_ttft_cold_minus_warm_ms"] or {}
        lines.append(
            f"| {label} | {_fmt(free['mean_tpot_ms'])} / {_fmt(free['median_tpot_ms'])} | "
            f"{_fmt(warm['mean_tpot_ms'])} / {_fmt(warm['median_tpot_ms'])} | {_fmt(s['tpot_ratio']['mean'], '.3f')} | "
            f"{_fmt(s['tpot_ratio']['median'], '.3f')} | {_fmt(s['cold_tpot_ratio']['mean'], '.3f')} | "
            f"{_fmt(warm['valid_frac'], '.2f')}; {_fmt(cold['valid_frac'], '.2f')} | {_fmt(probe.get('mean'))} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ command line
FULL = {"repeats": 3, "probes": len(NAME_TO_SCHEMA), "compile_repeats": 5}
QUICK = {"repeats": 1, "probes": 2, "compile_repeats": 1}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay bench structured", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct",
                   help="model directory (`kvrelay model pull smollm2-135m-instruct --dir DIR`)")
    p.add_argument("--concurrency", type=int, default=16, help="requests sent at once in every pass")
    p.add_argument("--max-tokens", type=int, default=384,
                   help="a constrained request's limit (the schemas end well before it)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"warm constrained + unconstrained pass pairs per server; default {FULL['repeats']}")
    p.add_argument("--probes", type=int, default=None,
                   help=f"schemas whose lone first request is timed cold and warm; default {FULL['probes']}")
    p.add_argument("--compile-repeats", type=int, default=None,
                   help=f"in-process compiles of every schema; default {FULL['compile_repeats']}")
    p.add_argument("--quick", action="store_true",
                   help=f"a short look: {QUICK['repeats']} pass pair, {QUICK['probes']} probes, "
                        f"{QUICK['compile_repeats']} compile repeat, unless given (add --no-vllm to skip vLLM's "
                        "~3.5-minute start)")
    p.add_argument("--disaggregation", choices=("always", "auto", "never"), default="always",
                   help="kvrelay's router.disaggregation (always: every prompt prefilled on the prefill node, the "
                        "first token sampled there, the rest on the decode node)")
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's CPU build")
    p.add_argument("--peer-script", default=str(DEFAULT_PEER_SCRIPT))
    p.add_argument("--vllm-args", default="", help="extra flags for `vllm serve`, one string (shell words), e.g. "
                        "'--structured-outputs-config.disable_any_whitespace true'")
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line with ``--quick`` / full defaults filled in.

    Exits (argparse) on a count below its minimum or a model directory without ``config.json``.
    """
    p = build_parser()
    a = p.parse_args(argv)
    defaults = QUICK if a.quick else FULL
    for name in ("repeats", "probes", "compile_repeats"):
        if getattr(a, name) is None:
            setattr(a, name, defaults[name])
    for flag, value, low in (("--concurrency", a.concurrency, 1), ("--max-tokens", a.max_tokens, 2),
                             ("--repeats", a.repeats, 1), ("--probes", a.probes, 0),
                             ("--compile-repeats", a.compile_repeats, 1)):
        if value < low:
            p.error(f"{flag} {value}: must be at least {low}")
    a.probes = min(a.probes, len(NAME_TO_SCHEMA))
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay model pull smollm2-135m-instruct --dir "
                f"{a.model}` writes one")
    return a


def main(argv: list[str] | None = None) -> int:
    from kvrelay.benchmarks.deployment import Deployment, get_text
    from kvrelay.benchmarks.peer import PeerServer
    from kvrelay.engine.grammar import GrammarError

    a = parse_args(argv)
    try:
        compiled = compile_times(a.model, repeats=a.compile_repeats).summary()
        print(f"structured: compile per schema mean {compiled['mean_ms']:.1f} ms, max {compiled['max_ms']:.1f} ms "
              f"(vocabulary setup {compiled['setup_ms']:.0f} ms)", file=sys.stderr, flush=True)
    except GrammarError as exc:  # the servers are still measured: they answer for themselves
        compiled = {"error": str(exc)}
        print(f"structured: compiling failed: {exc}", file=sys.stderr, flush=True)
    plan = Plan(make_tasks(a.concurrency), a.max_tokens, a.repeats, a.probes, a.request_timeout_s)
    servers: dict[str, dict[str, Any]] = {}
    overrides = {"router": {"disaggregation": a.disaggregation}}
    with Deployment(a.model, overrides=overrides) as d:
        servers["kvrelay"] = {**measure_server("kvrelay", d.url, d.model_name, plan), "overrides": overrides}
    if not a.no_vllm:
        vllm_args = shlex.split(a.vllm_args)
        with PeerServer(a.peer_script, a.model, extra_args=vllm_args) as peer:
            try:
                version = json.loads(get_text(peer.url + "/version")).get("version")
            except (OSError, ValueError):
                version = None
            servers["vllm"] = {**measure_server("vllm", peer.url, "peer", plan), "vllm_args": vllm_args,
                               "version": version}
    table = markdown_table(servers)
    print(table, file=sys.stderr)
    kv_ratio = servers["kvrelay"]["tpot_ratio"]["mean"]
    emit({"benchmark": "structured", **machine_label(), "model": a.model, "concurrency": a.concurrency,
          "max_tokens": a.max_tokens, "repeats": a.repeats, "disaggregation": a.disaggregation,
          "length_matching": "each unconstrained request: max_tokens = its constrained twin's output tokens, "
                             "ignore_eos true; constrained: ignore_eos false, stopped by the grammar",
          "schemas": NAME_TO_SCHEMA, "compile": compiled,
          "side_by_side": {label: {"tpot_ratio": s["tpot_ratio"], "cold_tpot_ratio": s["cold_tpot_ratio"],
                                   "valid_frac": s["passes"]["constrained"]["valid_frac"]}
                           for label, s in servers.items()},
          "target_tpot_ratio": TARGET_TPOT_RATIO,
          "kvrelay_meets_target": None if kv_ratio is None else kv_ratio <= TARGET_TPOT_RATIO,
          "servers": servers, "table_md": table}, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
