"""`NetnsDeployment`: one deployment across "hosts" — a Linux network namespace per node and one for the router
(`benchmarks.netns.Hosts`) — so that every request, event poll and KV pull crosses a real TCP link (veth and a
bridge; NIXL over UCX with ``UCX_TLS=tcp``), for benchmarks that compare deployments on multi-host.

The same face as `benchmarks.deployment.Deployment` (``url``, ``model_name``, ``prefill_urls``,
``decode_urls``; a context manager), from the same base config and overrides. Each node is its own
``kvrelay prefill|decode --name <host>`` process pinned to its own share of this machine's CPUs
(`deploy.cpu_budget.split_cpus`, nothing lent: what ``kvrelay up --no-cpu-lending`` gives them on one host);
the router runs unpinned in its host. KV tiers are sized per node (``NODE_KV``: ``kvrelay up``'s split is
per machine, and here each node starts alone) and each node's disk tier is a fresh directory.

Needs root (`benchmarks.netns.netns_problem` says why not).
"""

from __future__ import annotations

import json
import os
import secrets
import sys
import tempfile
import time
import urllib.error
from pathlib import Path
from typing import Any

import yaml
from kvrelay.benchmarks.deployment import get_text, merge
from kvrelay.benchmarks.netns import Hosts, netns_problem
from kvrelay.deploy.config import DEFAULT_CONFIG
from kvrelay.deploy.cpu_budget import available_cpus, format_cpus, split_cpus

PREFILL_PORT, DECODE_PORT, ROUTER_PORT = 8100, 8200, 8000
NODE_KV = {"device": {"bytes": "2GiB"}, "host": {"bytes": "1GiB"}}
TOKEN_ENV = "KVRELAY_INTERNAL_TOKEN"
REPO = Path(__file__).resolve().parents[1]


class NetnsDeployment:
    """``config``'s nodes (``prefill.ports`` / ``decode.ports`` give how many of each; their numbers are not
    used) each on a host of its own, and the router on another.

    Raises:
        RuntimeError: from `start`: network namespaces cannot be made here, or the deployment was not
            ready in time (with the hosts' last log lines).
    """

    def __init__(self, model_dir: str | Path, *, overrides: dict[str, dict[str, Any]] | None = None,
                 base_config: Path = DEFAULT_CONFIG) -> None:
        self.config: dict[str, Any] = merge(yaml.safe_load(base_config.read_text()), overrides or {})
        self.model_dir = Path(model_dir).resolve()
        self.model_name: str = self.config.get("model", {}).get("name", self.model_dir.name)
        num_prefill = len(self.config.get("prefill", {}).get("ports", []))
        num_decode = len(self.config.get("decode", {}).get("ports", [0]))
        self.prefill_hosts = [f"prefill-{i}" for i in range(num_prefill)]
        self.node_hosts = self.prefill_hosts + [f"decode-{i}" for i in range(num_decode)]
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-netns-")
        self.work = Path(self._tmp.name)
        self._hosts: Hosts | None = None
        self.url = ""
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self._token = secrets.token_hex(16)

    def _url(self, host: str) -> str:
        assert self._hosts is not None
        port = PREFILL_PORT if host.startswith("prefill") else DECODE_PORT if host.startswith("decode") else ROUTER_PORT
        return f"http://{self._hosts.addr(host)}:{port}"

    def host_config(self, host: str) -> dict[str, Any]:
        """The config the process on ``host`` reads: the deployment's, bound to that host's address."""
        assert self._hosts is not None
        cfg = merge(self.config, {
            "model": {"path": str(self.model_dir)},
            "internal": {"bind": self._hosts.addr(host), "token_env": TOKEN_ENV},
            # no prefill host: no prefill port either (an empty router.prefill_urls means one per local port)
            "prefill": {"ports": [PREFILL_PORT] if self.prefill_hosts else []}, "decode": {"ports": [DECODE_PORT]},
            "router": {"host": self._hosts.addr("router"), "port": ROUTER_PORT,
                       "prefill_urls": [self._url(h) for h in self.node_hosts if h.startswith("prefill")],
                       "decode_urls": [self._url(h) for h in self.node_hosts if h.startswith("decode")]},
        })
        kv = cfg.setdefault("kvstore", {})
        kv.update({tier: dict(size) for tier, size in NODE_KV.items()})
        if kv.get("disk"):
            kv["disk"] = {**kv["disk"], "path": str(self.work / host / "disk")}
        return cfg

    def start(self, timeout_s: float = 300.0) -> NetnsDeployment:
        problem = netns_problem()
        if problem is not None:
            raise RuntimeError(f"a multi-host deployment needs network namespaces: {problem}")
        self._hosts = Hosts(["router", *self.node_hosts], self.work).__enter__()
        env = {**os.environ, TOKEN_ENV: self._token, "UCX_TLS": "tcp", "PYTHONPATH": str(REPO)}
        shares = split_cpus(available_cpus(), len(self.node_hosts))
        try:
            for host in ["router", *self.node_hosts]:
                path = self.work / f"{host}.yaml"
                path.write_text(yaml.safe_dump(self.host_config(host)))
                role = host.split("-")[0]
                argv = [sys.executable, "-m", "kvrelay.deploy.cli", role, "--config", str(path)]
                if role != "router":
                    argv += ["--name", host, "--cpus", format_cpus(shares[self.node_hosts.index(host)])]
                self._hosts.popen(host, argv, env=env, log_name=f"{host}.log")
            self.url = self._url("router")
            deadline = time.monotonic() + timeout_s
            while not self._ready():
                if time.monotonic() > deadline:
                    raise RuntimeError("the multi-host deployment was not ready in time:\n" + self.logs())
                time.sleep(0.5)
        except BaseException:
            self.stop()
            raise
        self.prefill_urls = [self._url(h) for h in self.node_hosts if h.startswith("prefill")]
        self.decode_urls = [self._url(h) for h in self.node_hosts if h.startswith("decode")]
        return self

    def _ready(self) -> bool:
        try:
            nodes = json.loads(get_text(self.url + "/health", timeout_s=5, token=self._token))["nodes"]
        except (OSError, ValueError, KeyError, urllib.error.HTTPError):
            return False
        return len(nodes) == len(self.node_hosts) and all(n.get("healthy") for n in nodes.values())

    def logs(self, lines: int = 30) -> str:
        out = []
        for host in ["router", *self.node_hosts]:
            try:
                text = (self.work / f"{host}.log").read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"---- {host} ----\n" + "\n".join(text[-lines:]))
        return "\n".join(out)

    def stop(self) -> None:
        """Stop every process (SIGTERM, then SIGKILL) and remove the namespaces; idempotent."""
        if self._hosts is not None:
            self._hosts.__exit__(None, None, None)
            self._hosts = None
        self._tmp.cleanup()

    def __enter__(self) -> NetnsDeployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
