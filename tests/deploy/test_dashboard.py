"""Issue 34: every PromQL expression of the Grafana dashboard (`deploy/grafana/kvrelay.json`) and the alert rules
(`deploy/prometheus/alerts.yaml`) names only metrics a running router or node exports, with labels they carry.

The exported names come from a real deployment (``kvrelay up`` on the tiny model, one request through it), read
from each service's ``/metrics``: every family's ``# TYPE`` line (present even before a labelled metric has a
child) expanded to the sample names Prometheus stores (``_bucket``/``_sum``/``_count`` of a histogram, …).
"""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
import yaml

from tests.services.cluster import Cluster

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy/grafana/kvrelay.json"
ALERTS = ROOT / "deploy/prometheus/alerts.yaml"
METRICS_PAGE = ROOT / "docs/operations/metrics.md"
# Series Prometheus makes itself for each scrape target, not exported by the services.
SCRAPER_SERIES = frozenset({"up"})
# Labels Prometheus attaches to every series it scrapes (the target's), beside the services' own.
TARGET_LABELS = frozenset({"instance", "job", "le", "quantile"})
# The sample names each family type exposes, by suffix (the ``# TYPE`` line names a counter with ``_total``).
TYPE_TO_SUFFIXES = {
    "counter": ("",), "gauge": ("",), "untyped": ("",), "info": ("",), "stateset": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count", "_created"),
}
PROMQL_WORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
                          "and", "or", "unless", "inf", "nan", "atan2"})
NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects: identifiers that are not functions, keywords, label names
    (inside ``{...}`` or a ``by (...)``-style list), strings or durations.

    >>> sorted(metric_names('sum by (le) (rate(a_bucket{x="y"}[5m])) / ignoring (t) group_left sum(b)'))
    ['a_bucket', 'b']
    """
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for m in NAME.finditer(text):
        word = m.group(0)
        before = text[m.start() - 1] if m.start() else " "
        if before.isdigit() or before == ".":  # the unit of a number such as 1e3, or 5m outside brackets
            continue
        if re.match(r"\s*\(", text[m.end():]) or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def selector_labels(expr: str) -> list[tuple[str, set[str]]]:
    """``(metric, label names)`` for each ``metric{...}`` selector, and for each metric inside an aggregation
    ``by (labels) (...)`` (the labels it groups by must be on the metrics it aggregates)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    out = [(m.group(1), set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*[=!]~?", m.group(2))))
           for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*\{([^}]*)\}", text)]
    for m in re.finditer(r"\bby\s*\(([^)]*)\)\s*\(", text):
        depth, end = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[end], 0)
            end += 1
        labels = {label.strip() for label in m.group(1).split(",") if label.strip()}
        out += [(name, labels) for name in metric_names(text[m.end():end - 1])]
    return out


def dashboard_exprs() -> list[str]:
    def panels(items: list[dict]) -> list[dict]:
        return [p for item in items for p in (item, *panels(item.get("panels", [])))]

    board = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in panels(board["panels"]) for t in p.get("targets", [])]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [str(rule["expr"]) for group in rules["groups"] for rule in group["rules"]]


SAMPLE = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+\S+\s*$")


def exported(url: str) -> dict[str, set[str] | None]:
    """``{sample name: label names seen on its samples}`` of every family ``url/metrics`` exposes; None for a
    name with no sample yet (a labelled metric nothing has incremented)."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, set[str] | None] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, family, kind = line.split(" ", 3)
            for suffix in TYPE_TO_SUFFIXES[kind]:
                out.setdefault(family + suffix, None)
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            labels = set(re.findall(r'([A-Za-z_][A-Za-z0-9_]*)="', m.group(2) or ""))
            out[m.group(1)] = (out.get(m.group(1)) or set()) | labels
    return out


@pytest.fixture(scope="module")
def exported_metrics(tiny_model_dir: Path) -> dict[str, set[str] | None]:
    """Every sample name (with its label names) the router, a prefill node and a decode node export."""
    with Cluster(tiny_model_dir) as c:
        body = json.dumps({"model": "tiny", "prompt": list(range(3, 40)), "max_tokens": 4,
                           "temperature": 0}).encode()
        req = urllib.request.Request(c.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
        names: dict[str, set[str] | None] = {}
        for url in (c.url, *c.prefill_urls, *c.decode_urls):
            for name, labels in exported(url).items():
                if labels is None:
                    names.setdefault(name, None)
                else:
                    names[name] = (names.get(name) or set()) | labels
    return names


def test_metric_names_are_read_from_expressions() -> None:
    expr = ('histogram_quantile(0.99, sum by (le, plan) (rate(kvrelay_router_plan_ttft_error_ratio_bucket'
            '[$__rate_interval]))) > 1e3 and on (instance) vllm:kv_cache_usage_perc{role="x"} offset 5m')
    assert metric_names(expr) == {"kvrelay_router_plan_ttft_error_ratio_bucket", "vllm:kv_cache_usage_perc"}
    assert metric_names('up{job=~"kvrelay.*"} == 0') == {"up"}
    assert selector_labels('sum by (reason) (rate(a_total{where="x"}[5m])) / sum by (i) (b)') == [
        ("a_total", {"where"}), ("a_total", {"reason"}), ("b", {"i"})]


def test_the_dashboard_and_alerts_have_expressions() -> None:
    board = json.loads(DASHBOARD.read_text())
    assert any(v["type"] == "datasource" and v["query"] == "prometheus" for v in board["templating"]["list"])
    assert len(dashboard_exprs()) >= 30 and len(alert_exprs()) >= 10
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert all(r["annotations"].get("summary") for r in rules), "every alert needs a summary annotation"


def test_every_expression_names_an_exported_metric(exported_metrics: dict[str, set[str] | None]) -> None:
    unknown = {(name, expr) for expr in dashboard_exprs() + alert_exprs() for name in metric_names(expr)
               if name not in exported_metrics and name not in SCRAPER_SERIES}
    assert not unknown, f"metrics nobody exports: {sorted(unknown)}"


def test_every_label_an_expression_uses_is_on_its_metric(exported_metrics: dict[str, set[str] | None]) -> None:
    """Checked where the run gave the metric a sample (a labelled metric nothing incremented shows no labels)."""
    wrong = set()
    for expr in dashboard_exprs() + alert_exprs():
        for name, labels in selector_labels(expr):
            seen = exported_metrics.get(name)
            if name in SCRAPER_SERIES or seen is None:
                continue
            extra = labels - seen - TARGET_LABELS
            if extra:
                wrong.add((name, tuple(sorted(extra)), expr))
    assert not wrong, f"labels these metrics do not carry: {sorted(wrong)}"


def test_every_metric_the_metrics_page_lists_is_exported(exported_metrics: dict[str, set[str] | None]) -> None:
    """The tables of docs/operations/metrics.md name families (a histogram by its base name)."""
    rows = [line for line in METRICS_PAGE.read_text().splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`((?:kvrelay_|vllm:)[A-Za-z0-9_:]*)`", row.split("|")[1])}
    assert len(listed) >= 40
    missing = sorted(n for n in listed if n not in exported_metrics and n + "_bucket" not in exported_metrics)
    assert not missing, f"docs/operations/metrics.md lists metrics nobody exports: {missing}"
