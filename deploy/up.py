"""``kvrelay up``: router + prefill + decode nodes from one YAML file, on this machine.

Starts every node as its own process (``kvrelay prefill|decode|router --config FILE --index I``), each
engine node on its own share of this machine's CPUs (`deploy.cpu_budget`),
waits until the router reports healthy, prints the URL, and on Ctrl-C or SIGTERM stops all of them:
SIGTERM, then it waits for each node to drain (``internal.drain_timeout_s``) and write its device and
host KV to disk (``internal.persist_timeout_s``), SIGKILLing (and saying so) only a node still running
``GRACE_S`` past both; it exits 0. A node that dies later is restarted. SIGUSR1 prints the
supervisor's stack (to find where a start-up hangs).
"""

from __future__ import annotations

import faulthandler
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvrelay.deploy.cpu_budget import available_cpus, format_cpus, split_cpus
from kvrelay.deploy.memory import format_bytes, free_host_bytes, nvml_device_count
from kvrelay.deploy.service_config import TOKEN_ENV
from kvrelay.deploy.sizes import ConfigError
from kvrelay.transfer.config import TOKEN_HEADER

GRACE_S = 10.0  # beyond internal.drain_timeout_s + internal.persist_timeout_s, before SIGKILL
RESTART_BACKOFF_S = 2.0
REPORT_EVERY_S = 30.0


def _role_cmd(role: str, config_path: Path, index: int, overrides: list[str], cpus: list[int] | None,
              lending: tuple[list[int], str] | None = None, memory_budget_bytes: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "kvrelay.deploy.cli", role, "--config", str(config_path), "--index", str(index),
           "--name", f"{role}-{index}", *overrides]
    if memory_budget_bytes is not None and role != "router":
        cmd += ["--memory-budget", str(memory_budget_bytes)]
    if cpus is None:
        return cmd
    cmd += ["--cpus", format_cpus(cpus)]
    if lending is not None:
        cmd += ["--cpu-pool", format_cpus(lending[0]), "--cpu-lock-dir", lending[1]]
    return cmd


def node_env(env: dict[str, str], config: Any, role: str, index: int) -> dict[str, str]:
    """The environment of node ``index`` of ``role``: ``env``, with CUDA_VISIBLE_DEVICES set to the
    node's entry of ``<role>.devices`` when the config assigns devices (else inherited: every node of
    this machine sees every device)."""
    devices = config.prefill.devices if role == "prefill" else config.decode.devices if role == "decode" else ()
    if not devices:
        return env
    return {**env, "CUDA_VISIBLE_DEVICES": devices[index]}


def _router_health(url: str, token: str | None) -> dict[str, Any] | None:
    """The router's full ``/health`` body (also when it answers 503; ``token``: the internal token, without
    which it is only the status), or None when it does not answer."""
    req = urllib.request.Request(url + "/health", headers={TOKEN_HEADER: token} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as err:
        try:
            return json.loads(err.read())
        except (OSError, ValueError):
            return None
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _waiting_for(health: dict[str, Any] | None) -> str:
    """What the deployment still waits for, from the router's ``/health`` (None: router not answering)."""
    if health is None:
        return "the router does not answer /health"
    if "nodes" not in health:
        return f"router status {health.get('status')!r}"
    down = [f"{name} ({n.get('last_error') or 'not answered yet'})" if not n["healthy"]
            else f"{name} (no load report yet)"
            for name, n in sorted(health["nodes"].items()) if not n["healthy"] or n.get("capacity") is None]
    return "waiting for " + ", ".join(down) if down else f"router status {health.get('status')!r}"


def _stop(procs: list[subprocess.Popen], names: list[str], *, drain_s: float, persist_s: float,
          grace_s: float = GRACE_S) -> None:
    """SIGTERM every process and wait for them to exit; SIGKILL, with a line naming it, one still running
    after ``drain_s + persist_s + grace_s`` (a node drains, then writes its KV to disk, then exits)."""
    running = [(p, name) for p, name in zip(procs, names) if p.poll() is None]
    for p, _ in running:
        p.send_signal(signal.SIGTERM)
    if running:
        print(f"kvrelay up: stopping; nodes drain (up to {drain_s:g} s) and write their KV to disk (up to "
              f"{persist_s:g} s)", file=sys.stderr, flush=True)
    limit_s = drain_s + persist_s + grace_s
    deadline = time.monotonic() + limit_s
    for p, name in running:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            print(f"kvrelay up: {name} still running {limit_s:g} s after SIGTERM (internal.drain_timeout_s "
                  f"{drain_s:g} + internal.persist_timeout_s {persist_s:g} + {grace_s:g}); SIGKILL: KV it had not "
                  f"written to disk is lost", file=sys.stderr, flush=True)
            p.kill()
            p.wait()


def check_model_fits_config(config: Any) -> None:
    """Refuse, before any node starts, what the model's ``config.json`` rules out: a long-context policy
    (H2O, InfiniGen) for a model with sliding-window layers or attention sinks (the engine refuses it too,
    but from inside each node's start).

    Raises:
        ConfigError: naming ``decode.long_context.policy`` and the model's family.
    """
    from kvrelay.model.config import read_model_config  # no torch: config parsing only

    policy = config.decode.long_context.policy
    if policy == "none" or not (Path(config.model.path) / "config.json").is_file():
        return
    try:
        model = read_model_config(config.model.path)
    except ValueError:
        return  # the node reports an unsupported model itself, with the path
    if model.long_context_refusal is not None:
        raise ConfigError(f"decode.long_context.policy: {policy} is not supported for {model.long_context_refusal}, "
                          f"{config.model.path}; use none")


def check_gpu_shares(config: Any, *, gpu_count: Callable[[], int] = nvml_device_count) -> None:
    """Refuse a ``kvstore.device.gpu_memory_utilization`` that the engine nodes sharing one GPU cannot all take:
    it is each node's share of the GPU's total memory (vLLM's per-instance meaning), so the nodes on one GPU
    must sum to at most 1. Nodes without ``<role>.devices`` entries share the GPU ``model.device`` names.
    Nothing to check on a CPU device, or with ``auto`` where ``gpu_count()`` (NVML) sees no GPU.

    Raises:
        ConfigError: naming the key, the GPU, its nodes and the largest share that fits.
    """
    utilization = config.kvstore.device.gpu_memory_utilization
    device = config.model.device
    if utilization is None or device == "cpu" or (device == "auto" and gpu_count() == 0):
        return
    gpu_to_nodes: dict[str, list[str]] = {}
    for role, section in (("prefill", config.prefill), ("decode", config.decode)):
        for i in range(len(section.ports)):
            gpu = f"CUDA_VISIBLE_DEVICES={section.devices[i]}" if section.devices else device
            gpu_to_nodes.setdefault(gpu, []).append(f"{role}-{i}")
    for gpu, nodes in sorted(gpu_to_nodes.items()):
        if len(nodes) * utilization > 1 + 1e-9:
            raise ConfigError(
                f"kvstore.device.gpu_memory_utilization: {utilization:g} is each node's share of its GPU's memory, "
                f"and {len(nodes)} nodes ({', '.join(nodes)}) share {gpu}: {len(nodes) * utilization:g} of it; use "
                f"at most {1 / len(nodes):.2f}, or give each node its own GPU (prefill.devices, decode.devices)")


def up(config: Any, config_path: Path, *, overrides: list[str], startup_timeout_s: float = 300.0,
       lend_cpus: bool = True) -> int:
    """Run the whole deployment until a signal; returns the exit code.

    A prefill or decode node that dies after start is restarted after ``RESTART_BACKOFF_S`` (the
    router routes around it meanwhile), as a Kubernetes Deployment would; a router that dies, or any
    process that dies before the deployment became healthy, stops everything.

    With ``lend_cpus`` (and more than one engine node, no more nodes than CPUs) a node's CPUs are lent
    to the others while it has nothing to compute (`deploy.cpu_budget.CoreLending`).
    """
    check_model_fits_config(config)
    check_gpu_shares(config)
    plan = [("prefill", i) for i in range(len(config.prefill.ports))]
    plan += [("decode", i) for i in range(len(config.decode.ports))]
    cpus = available_cpus()
    shares: list[list[int] | None] = [*split_cpus(cpus, len(plan)), None]  # the router takes no share
    # Nodes lend idle CPUs to each other (`CoreLending`) unless they already share CPUs.
    lock_dir = tempfile.mkdtemp(prefix="kvrelay-cpus-") if lend_cpus and 1 < len(plan) <= len(cpus) else None
    lending = (cpus, lock_dir) if lock_dir is not None else None
    if len(cpus) < len(plan):
        print(f"kvrelay up: {len(plan)} engine nodes share {len(cpus)} CPUs; they will slow each other down",
              file=sys.stderr, flush=True)
    # Host memory free now, shared by the engine nodes: each sizes its fraction_of_free tiers from its share.
    budget = free_host_bytes() // max(1, len(plan))
    print(f"kvrelay up: {format_bytes(budget * len(plan))} of host memory free; each of the {len(plan)} engine "
          f"nodes sizes its fraction_of_free KV tiers from {format_bytes(budget)}", flush=True)
    plan.append(("router", 0))
    # Every node gets the internal token: the config's, else one made up for this deployment's life.
    env = dict(os.environ)
    if config.internal.token is None:
        env[TOKEN_ENV] = secrets.token_urlsafe(32)
    procs: list[subprocess.Popen] = []
    restart_at: dict[int, float] = {}
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints where this process is (stderr)
    try:
        for role, index in plan:
            procs.append(subprocess.Popen(_role_cmd(role, config_path, index, overrides, shares[len(procs)], lending,
                                                    budget), env=node_env(env, config, role, index)))
        url = f"http://{config.router.host}:{config.router.port}"
        deadline = time.monotonic() + startup_timeout_s
        next_report = time.monotonic() + REPORT_EVERY_S
        ready = False
        while not stopping:
            now = time.monotonic()
            for k, ((role, index), p) in enumerate(zip(plan, procs)):
                if p.poll() is None:
                    continue
                if not ready or role == "router":
                    print(f"kvrelay up: {role}-{index} exited with code {p.returncode}; stopping everything",
                          file=sys.stderr, flush=True)
                    return 1
                if k not in restart_at:
                    print(f"kvrelay up: {role}-{index} exited with code {p.returncode}; restarting in "
                          f"{RESTART_BACKOFF_S:.0f} s", file=sys.stderr, flush=True)
                    restart_at[k] = now + RESTART_BACKOFF_S
                elif now >= restart_at[k]:
                    del restart_at[k]
                    procs[k] = subprocess.Popen(_role_cmd(role, config_path, index, overrides, shares[k], lending,
                                                          budget), env=node_env(env, config, role, index))
            if not ready:
                health = _router_health(url, config.internal.token or env.get(TOKEN_ENV))
                # every node answered and reported its room (until then the router cannot bound what it places)
                all_up = health is not None and all(n["healthy"] and n.get("capacity") is not None
                                                    for n in health.get("nodes", {}).values())
                if health is not None and health.get("status") == "ok" and all_up:
                    ready = True
                    print(f"kvrelay is serving {config.model.name!r} at {url}/v1 "
                          f"({len(config.prefill.ports)} prefill, {len(config.decode.ports)} decode)", flush=True)
                elif now > deadline:
                    print(f"kvrelay up: not healthy after {startup_timeout_s:.0f} s: {_waiting_for(health)}",
                          file=sys.stderr, flush=True)
                    return 1
                elif now >= next_report:
                    next_report = now + REPORT_EVERY_S
                    print(f"kvrelay up: still starting: {_waiting_for(health)}", file=sys.stderr, flush=True)
            time.sleep(0.2 if ready else 0.05)  # starting: notice readiness at once (a local router answers in ~1 ms)
        return 0
    finally:
        _stop(procs, [f"{role}-{index}" for role, index in plan[: len(procs)]],
              drain_s=config.internal.drain_timeout_s, persist_s=config.internal.persist_timeout_s)
        if lock_dir is not None:
            shutil.rmtree(lock_dir, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)
