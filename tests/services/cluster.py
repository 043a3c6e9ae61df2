"""Start a real kvrelay deployment (``kvrelay up``) on loopback ports for a test, and tear it down."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

READY = re.compile(r"kvrelay is serving .* at (http://\S+)/v1")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def get_json(url: str, *, headers: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    req = urllib.request.Request(url, headers=headers or {})
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def metrics(url: str) -> dict[str, float]:
    """Prometheus text at ``url/metrics`` as ``{'name{labels}': value}``."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


class Cluster:
    """``kvrelay up`` over a config built from ``overrides`` on fresh ports.

    Attributes:
        url: the router, e.g. ``http://127.0.0.1:PORT``.
        prefill_urls, decode_urls: the nodes.
    """

    def __init__(self, tmp: Path, model_dir: Path, *, prefill: int = 1, decode: int = 1,
                 overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> None:
        ports = free_ports(1 + prefill + decode)
        self.config: dict[str, Any] = {
            "model": {"path": str(model_dir), "name": "tiny"},
            "kvstore": {"block_size_tokens": 16, "device": {"bytes": "8MiB"}},
            "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
            "prefill": {"ports": ports[1 : 1 + prefill], "lease_ttl_s": 10},
            "decode": {"ports": ports[1 + prefill :], "transfer_timeout_s": 10},
            "router": {"port": ports[0], "request_timeout_s": 60},
        }
        for section, values in (overrides or {}).items():
            self.config[section] = {**self.config.get(section, {}), **values}
        self.path = tmp / "kvrelay.yaml"
        self.path.write_text(yaml.safe_dump(self.config))
        self.url = f"http://127.0.0.1:{ports[0]}"
        self.prefill_urls = [f"http://127.0.0.1:{p}" for p in self.config["prefill"]["ports"]]
        self.decode_urls = [f"http://127.0.0.1:{p}" for p in self.config["decode"]["ports"]]
        self.log: list[str] = []
        self._env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> Cluster:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "deploy.cli", "up", "--config", str(self.path)], stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env=self._env, start_new_session=True,
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stdout is not None
            for line in self.proc.stdout:
                self.log.append(line)
                if READY.search(line):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("kvrelay up did not become ready:\n" + "".join(self.log[-40:]))
        return self

    def node_pid(self, url: str) -> int:
        return int(get_json(url + "/health")["pid"])

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is not None:  # show what the services said next to the failure
            sys.stderr.write("---- kvrelay up output (last 60 lines) ----\n" + "".join(self.log[-60:]))
