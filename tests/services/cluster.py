"""A real kvrelay deployment (``kvrelay up`` on free loopback ports) for a test, and reading its state."""

from __future__ import annotations

import json
import os
import signal
import sys
import urllib.request
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.deployment import Deployment, merge
from kvrelay.transfer.config import TOKEN_HEADER

TEST_TOKEN_ENV = "KVRELAY_INTERNAL_TOKEN"
TEST_TOKEN = "kvrelay-test-token"  # a Cluster's internal token unless its env names another


HOOKS = Path(__file__).parent / "hooks"  # test-only sitecustomize for node processes (see its docstring)


def publish_faults(*faults: str) -> dict[str, str]:
    """A `Cluster` ``env`` whose prefill nodes inject ``faults`` (`transfer.config.PUBLISH_FAULTS`) through the
    test hook; no configuration key turns them on."""
    return {"KVRELAY_TEST_PUBLISH_FAULTS": ",".join(faults),
            "PYTHONPATH": os.pathsep.join([str(HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])])}


def get_json(url: str, *, headers: dict[str, str] | None = None, timeout: float = 5.0) -> Any:
    """The JSON at ``url``, asked with the tests' internal token (a ``/health`` answers in full only with it)."""
    req = urllib.request.Request(url, headers={TOKEN_HEADER: TEST_TOKEN, **(headers or {})})
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


class Cluster(Deployment):
    """The default config (``deploy/configs/local.yaml``: all three tiers) with ``prefill`` prefill and
    ``decode`` decode nodes, small limits for tests, and ``overrides`` merged on top."""

    def __init__(self, model_dir: Path, *, prefill: int = 1, decode: int = 1,
                 overrides: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                 nofile: tuple[int, int] | None = None) -> None:
        base = {
            "model": {"name": "tiny", "dtype": "float32"},  # exact: tests compare with a float32 engine
            # Small tiers (not the default share of free memory): many deployments start one after another.
            "kvstore": {"device": {"bytes": "64MiB"}, "host": {"bytes": "128MiB", "fraction_of_free": None}},
            "engine": {"max_num_seqs": 32, "max_num_batched_tokens": 512},
            "prefill": {"ports": [0] * prefill, "lease_ttl_s": 10},
            "decode": {"ports": [0] * decode, "transfer_timeout_s": 30},  # generous: CI machines are shared
            # The prefill node's path for every prompt (`router.plan`: auto would keep most test prompts on the
            # decode node); tests of the plans say so.
            "router": {"request_timeout_s": 60, "disaggregation": "always"},
            # The stop at the end of a test: a lease nobody reads any more (a refused handle) holds a prefill
            # node's drain until it expires (prefill.lease_ttl_s), and the default drain allows 30 s. Tests of
            # the drain set their own.
            "internal": {"drain_timeout_s": 2},
        }
        # The nodes' internal token (`kvrelay up` would make one up; tests that talk to nodes need it).
        self.token = (env or {}).get(TEST_TOKEN_ENV, TEST_TOKEN)
        super().__init__(model_dir, overrides=merge(base, overrides or {}), env={TEST_TOKEN_ENV: self.token,
                                                                                 **(env or {})}, nofile=nofile)

    def terminate(self, timeout_s: float = 600.0) -> int:
        """SIGTERM ``kvrelay up`` (a planned stop: it stops its nodes) and wait up to ``timeout_s`` for it to
        exit; returns its exit code. The deployment's files stay until `stop`.

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout_s``.
        """
        assert self._proc is not None, "not started"
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
        return self._proc.wait(timeout_s)

    def node_pid(self, url: str) -> int:
        return int(get_json(url + "/health")["pid"])

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is not None:  # show what the services said next to the failure
            sys.stderr.write("---- kvrelay up output (last 60 lines) ----\n" + "".join(self.log[-60:]))
