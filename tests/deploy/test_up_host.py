"""Issue 64: ``kvrelay up --host`` sets where the API listens: ``0.0.0.0`` answers on every address of the machine
(as a container's published port needs), the default only on 127.0.0.1. 127.0.0.2 stands for another interface:
a socket bound to 127.0.0.1 does not take its connections, one bound to every interface does."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvrelay.benchmarks.deployment import Deployment
from kvrelay.deploy.config import DEFAULT_CONFIG

from tests.services.cluster import Cluster

SMALL = {"model": {"name": "tiny", "dtype": "float32"},
         "kvstore": {"device": {"bytes": "64MiB"}, "host": {"bytes": "64MiB", "fraction_of_free": None}},
         "internal": {"drain_timeout_s": 2}}


def _models(url: str) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def test_up_host_0_0_0_0_answers_on_another_address(tiny_model_dir: Path) -> None:
    with Deployment(tiny_model_dir, base_config=DEFAULT_CONFIG, overrides=SMALL,
                    up_args=["--host", "0.0.0.0"]) as d:
        port = d.url.rsplit(":", 1)[1]
        assert _models(f"http://127.0.0.2:{port}") == ["tiny"]


def test_the_default_host_answers_on_loopback_only(tiny_model_dir: Path) -> None:
    with Cluster(tiny_model_dir) as c:
        port = c.url.rsplit(":", 1)[1]
        assert _models(c.url) == ["tiny"]
        with pytest.raises(urllib.error.URLError, match="Connection refused"):
            _models(f"http://127.0.0.2:{port}")
