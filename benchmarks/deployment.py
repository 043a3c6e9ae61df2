"""`Deployment`: one ``kvrelay up`` on free loopback ports, for benchmarks that start their own servers.

The config starts from a YAML file (default: ``deploy/configs/local.yaml``, the default deployment) and
applies per-section overrides; ports are always fresh, the disk tier goes to a temporary directory, and
the model path is the benchmark's model. Baselines are overrides::

    BASELINE_TO_OVERRIDES["aggregated"] == {"prefill": {"ports": []}}      # decode prefills itself

and extra ``kvrelay up`` arguments (``BASELINE_TO_UP_ARGS``: 1P1D without CPU lending).
"""

from __future__ import annotations

import json
import os
import re
import resource
import secrets
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

import yaml
from kvrelay.deploy.config import DEFAULT_CONFIG
from kvrelay.deploy.config_keys import TOKEN_ENV
from kvrelay.deploy.ports import free_ports
from kvrelay.transfer.config import TOKEN_HEADER

READY = re.compile(r"kvrelay is serving .* at (http://\S+)/v1")

BASELINE_TO_OVERRIDES: dict[str, dict[str, dict[str, Any]]] = {
    "disaggregated": {"router": {"disaggregation": "always"}},
    "aggregated": {"prefill": {"ports": []}},
    "prefix-cache-off": {"engine": {"enable_prefix_caching": False}},
    "disaggregated-static": {"router": {"disaggregation": "always"}},
    "disaggregated-auto": {"router": {"disaggregation": "auto"}},  # router.plan picks per request
    # The cost of block digests (issue 16): the default (sampled) against every block checked and none.
    "disaggregated-integrity-all": {"kvstore": {"integrity": "all"}, "router": {"disaggregation": "always"}},
    "disaggregated-integrity-off": {"kvstore": {"integrity": "off"}, "router": {"disaggregation": "always"}},
}
BASELINE_TO_UP_ARGS: dict[str, list[str]] = {"disaggregated-static": ["--no-cpu-lending"]}


def merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied recursively (mappings merge, anything else replaces); new dict."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def stop_process_group(proc: subprocess.Popen, *, grace_s: float = 30.0) -> None:
    """SIGTERM ``proc`` (it stops what it started), then SIGKILL its whole process group (it was started
    with ``start_new_session``) if it is still there after ``grace_s``; returns once it has exited."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def get_text(url: str, *, timeout_s: float = 10.0, token: str | None = None) -> str:
    """The body at ``url``; ``token``: sent as ``X-Kvrelay-Token`` (a ``/health`` answers in full only with it)."""
    req = urllib.request.Request(url, headers={TOKEN_HEADER: token} if token else {})
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return resp.read().decode()


def _limit_fds(nofile: tuple[int, int]) -> Callable[[], None]:
    """A ``preexec_fn`` setting the child's RLIMIT_NOFILE to ``nofile`` (soft, hard), as ``prlimit --nofile``."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)

    return limit


class Deployment:
    """``kvrelay up`` with ``overrides`` merged (recursively) into ``base_config``.

    Attributes (after `start`): ``url`` (router root), ``model_name``, ``prefill_urls``, ``decode_urls``,
    ``config`` (the dict written), ``log`` (the last lines the processes printed).
    """

    def __init__(self, model_dir: str | Path, *, overrides: dict[str, dict[str, Any]] | None = None,
                 base_config: Path = DEFAULT_CONFIG, env: dict[str, str] | None = None,
                 up_args: list[str] | None = None, nofile: tuple[int, int] | None = None) -> None:
        self.config: dict[str, Any] = merge(yaml.safe_load(base_config.read_text()), overrides or {})

        def wanted(role: str, default: list[int]) -> list[int]:
            """Free ports (0) for ``role``'s nodes, except those ``overrides`` names (configs may refer to them)."""
            ports = list(self.config.get(role, {}).get("ports", default))
            return ports if "ports" in ((overrides or {}).get(role) or {}) else [0] * len(ports)

        prefill_ports, decode_ports = wanted("prefill", []), wanted("decode", [0])
        num_prefill = len(prefill_ports)
        ports = free_ports(1 + num_prefill + len(decode_ports))
        self.config["model"] = {**self.config.get("model", {}), "path": str(Path(model_dir).resolve())}
        self.config.setdefault("prefill", {})["ports"] = [
            p or free for p, free in zip(prefill_ports, ports[1 : 1 + num_prefill], strict=True)]
        self.config.setdefault("decode", {})["ports"] = [
            p or free for p, free in zip(decode_ports, ports[1 + num_prefill :], strict=True)]
        self.config.setdefault("router", {})["port"] = ports[0]
        self._tmp = tempfile.TemporaryDirectory(prefix="kvrelay-bench-")
        disk = (self.config.get("kvstore") or {}).get("disk")
        if disk and "path" not in disk and "bytes" not in disk:  # only overrides (a policy), no disk tier
            self.config["kvstore"]["disk"] = disk = None
        if disk:
            self.config["kvstore"]["disk"] = {**disk, "path": str(Path(self._tmp.name) / "disk")}
        self.path = Path(self._tmp.name) / "kvrelay.yaml"
        self.path.write_text(yaml.safe_dump(self.config))
        host = self.config["router"].get("host", "127.0.0.1")
        self.url = f"http://{host}:{ports[0]}"
        self.model_name: str = self.config["model"].get("name", Path(model_dir).resolve().name)
        self.prefill_urls: list[str] = []
        self.decode_urls: list[str] = []
        self._log_path = Path(self._tmp.name) / "kvrelay-up.log"
        self._log_file: Any = None
        self._saved_log: list[str] | None = None
        self._env = {**os.environ, **(env or {})}
        if TOKEN_ENV not in self._env:  # the deployment's internal token, known here to read its full /health
            self._env[TOKEN_ENV] = secrets.token_urlsafe(24)
        self.token: str | None = self.config.get("internal", {}).get("token") or self._env[TOKEN_ENV] or None
        self._proc: subprocess.Popen | None = None
        self._up_args = list(up_args or [])
        self._nofile = nofile  # (soft, hard) RLIMIT_NOFILE of the deployment's processes; None: this process's

    def start(self, timeout_s: float = 300.0) -> Deployment:
        """Start, wait for ``kvrelay up``'s ready line (every node healthy), then read the node URLs from
        the router's ``/health``.

        The processes write to a log file, not a pipe, so nothing they print can block them.

        Raises:
            RuntimeError: the processes exited or were not ready in ``timeout_s``; carries the router's
                ``/health``, ``kvrelay up``'s stack and the last lines of the log.
        """
        self._log_file = open(self._log_path, "w")  # noqa: SIM115 - closed in stop()
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "kvrelay.deploy.cli", "up", "--config", str(self.path), *self._up_args],
            stdout=self._log_file, stderr=subprocess.STDOUT, start_new_session=True, env=self._env,
            preexec_fn=None if self._nofile is None else _limit_fds(self._nofile),
        )
        deadline = time.monotonic() + timeout_s
        while not any(READY.search(line) for line in self.log):  # up is ready: it restarts a node from now on
            if self._proc.poll() is not None or time.monotonic() > deadline:
                health = self._health()
                if self._proc.poll() is None:  # still running: have it print where it is (faulthandler)
                    self._proc.send_signal(signal.SIGUSR1)
                    time.sleep(1.0)
                self.stop()
                raise RuntimeError(f"kvrelay up did not become ready; router /health: {health}\n"
                                   + "".join(self.log[-40:]))
            time.sleep(0.05)
        nodes = json.loads(get_text(self.url + "/health", token=self.token)).get("nodes")
        if nodes is None:  # no token known here (`kvrelay up` made one up): the nodes are at their configured ports
            bind = self.config.get("internal", {}).get("bind", "127.0.0.1")
            host = "127.0.0.1" if bind in ("0.0.0.0", "") else bind
            nodes = {f"{role}-{i}": {"url": f"http://{host}:{port}"} for role in ("prefill", "decode")
                     for i, port in enumerate(self.config[role]["ports"])}
        self.prefill_urls = [n["url"] for name, n in sorted(nodes.items()) if name.startswith("prefill")]
        self.decode_urls = [n["url"] for name, n in sorted(nodes.items()) if name.startswith("decode")]
        return self

    def _health(self) -> Any:
        """The router's ``/health`` body (also a 503's), or why there is none."""
        try:
            return json.loads(get_text(self.url + "/health", timeout_s=5, token=self.token))
        except urllib.error.HTTPError as err:
            try:
                return json.loads(err.read())
            except ValueError:
                return f"HTTP {err.code}"
        except (OSError, ValueError) as exc:
            return repr(exc)

    @property
    def log(self) -> list[str]:
        """The processes' output so far, without the access-log lines of health and metrics polling."""
        if self._saved_log is not None:
            return self._saved_log
        try:
            lines = Path(self._log_path).read_text(errors="replace").splitlines(keepends=True)
        except OSError:
            return []
        return [line for line in lines if '"GET /health' not in line and '"GET /metrics' not in line]

    def stop(self) -> None:
        """SIGTERM the process group (``kvrelay up`` stops its nodes), SIGKILL after 30 s; idempotent."""
        if self._proc is not None:
            stop_process_group(self._proc)
            self._proc = None
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
            self._saved_log = self.log  # the file goes with the temporary directory
        self._tmp.cleanup()

    def __enter__(self) -> Deployment:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
