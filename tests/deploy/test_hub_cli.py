"""Issue 64: `kvrelay generate|serve|up` take a hub repo id (ORG/NAME) as a vLLM user types it. The hub is a cache
laid out by the test under a temp HF_HOME (`tests.hub_cache`), read by the real ``huggingface_hub`` in each
process; no test reaches a hub: offline mode, or an endpoint nothing listens on (``http://127.0.0.1:9``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.deploy.test_cli import run_all, wait_serving
from tests.hub_cache import write_hub_snapshot

UNREACHABLE = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused at once


@pytest.fixture()
def hf_home(tmp_path: Path, tiny_model_dir: Path) -> Path:
    """An HF_HOME whose hub cache holds ``kvtest/tiny`` (the tiny model) at main."""
    home = tmp_path / "hf"
    write_hub_snapshot(home / "hub", "kvtest/tiny", tiny_model_dir)
    return home


def hub_env(hf_home: Path, *, offline: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING_FACE_", "TRANSFORMERS_OFFLINE"))}
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1" if offline else "0", HF_HUB_DISABLE_TELEMETRY="1")
    if not offline:
        env["HF_ENDPOINT"] = UNREACHABLE
    return env


GENERATE = ("--prompt-ids", "5,6,7,8", "--max-tokens", "6", "--json", "--dtype", "float32")


def test_generate_by_name_reads_the_cache_offline_and_through_an_unreachable_hub(hf_home, tiny_model_dir, tmp_path):
    offline, online, local, missing, missing_online, bad_device = run_all(
        (hub_env(hf_home, offline=True), ("generate", "--model", "kvtest/tiny", *GENERATE)),
        # online with the hub unreachable: huggingface_hub falls back to the snapshot main names in the cache
        (hub_env(hf_home, offline=False), ("generate", "--model", "kvtest/tiny", *GENERATE)),
        (hub_env(hf_home, offline=True), ("generate", "--model", str(tiny_model_dir), *GENERATE)),
        (hub_env(hf_home, offline=True), ("generate", "--model", "kvtest/missing", *GENERATE)),
        (hub_env(hf_home, offline=False), ("generate", "--model", "kvtest/missing", *GENERATE)),
        (hub_env(hf_home, offline=True), ("generate", "--model", "kvtest/tiny", "--device", "gpu", *GENERATE)),
    )
    for run in (offline, online, local):
        assert run.returncode == 0, run.stderr
    assert json.loads(offline.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    assert json.loads(online.stdout)["token_ids"] == json.loads(local.stdout)["token_ids"]
    hub = hf_home / "hub"
    assert (f"kvrelay: fetching model 'kvtest/tiny' from the hub cache only (HF_HUB_OFFLINE is set) into {hub}\n"
            in offline.stderr)
    assert f"kvrelay: fetching model 'kvtest/tiny' from {UNREACHABLE} into {hub}\n" in online.stderr
    assert "kvrelay: fetching" not in local.stderr  # a directory never touches the hub
    assert missing.returncode == 2 and missing.stderr.endswith(
        f"error: model 'kvtest/missing' is not in the hub cache {hub} and HF_HUB_OFFLINE is set: download it first "
        "(`hf download kvtest/missing` on a machine with access, into this cache, or pass --download-dir), or unset "
        "HF_HUB_OFFLINE\n")
    assert missing_online.returncode == 2 and missing_online.stderr.endswith(
        f"error: model 'kvtest/missing' could not be fetched from {UNREACHABLE} (ConnectError) and is not in the hub "
        f"cache {hub}: check the network or HF_ENDPOINT, set HF_TOKEN for a gated or private repo, or download it "
        "first (`hf download kvtest/missing`) and set HF_HUB_OFFLINE=1\n")
    assert bad_device.returncode == 2
    assert bad_device.stderr.endswith("error: --device 'gpu' is not a device; use auto, cpu, cuda or cuda:N\n")
    for run in (missing, missing_online, bad_device):
        assert "Traceback" not in run.stderr


def test_up_and_serve_refuse_a_name_they_cannot_resolve_before_starting_anything(hf_home, tmp_path):
    cfg = tmp_path / "kv.yaml"
    cfg.write_text("model: {path: kvtest/missing}\nkvstore: {device: {bytes: 8MiB}}\n")
    up, serve = run_all((hub_env(hf_home, offline=True), ("up", "--config", str(cfg))),
                        (hub_env(hf_home, offline=False), ("serve", "kvtest/missing", "--kv-cache-memory", "8MiB")))
    hub = hf_home / "hub"
    assert up.returncode == 2 and up.stderr.endswith(
        f"kvrelay: config error: model.path: model 'kvtest/missing' is not in the hub cache {hub} and HF_HUB_OFFLINE "
        "is set: download it first (`hf download kvtest/missing` on a machine with access, into this cache, or pass "
        "--download-dir), or unset HF_HUB_OFFLINE\n")
    assert "kvrelay up:" not in up.stdout  # refused before sizing memory or starting a node
    assert serve.returncode == 2 and serve.stderr.endswith(
        f"kvrelay serve: model.path: model 'kvtest/missing' could not be fetched from {UNREACHABLE} (ConnectError) "
        f"and is not in the hub cache {hub}: check the network or HF_ENDPOINT, set HF_TOKEN for a gated or private "
        "repo, or download it first (`hf download kvtest/missing`) and set HF_HUB_OFFLINE=1\n")
    assert "Traceback" not in up.stderr + serve.stderr


def test_serve_by_name_runs_every_node_on_the_one_snapshot_under_the_repo_id(hf_home, tmp_path):
    from kvrelay.benchmarks.deployment import free_ports

    [port] = free_ports(1)
    snapshot = hf_home / "hub" / "models--kvtest--tiny" / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.deploy.cli", "serve", "kvtest/tiny", "--port", str(port),
         "--kv-cache-memory", "16MiB",
         "--dtype", "float32", "--max-num-seqs", "4"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env=hub_env(hf_home, offline=True))
    out: list[str] = []
    try:
        text = wait_serving(proc, out)
        assert f"kvrelay serve: model kvtest/tiny is {snapshot}\n" in text
        assert "kvrelay is serving 'kvtest/tiny'" in text
        device = "cuda" if torch.cuda.is_available() else "cpu"
        assert f"KV on {device}: device tier 16.0 MiB" in text  # device auto
        url = f"http://127.0.0.1:{port}"
        with urllib.request.urlopen(url + "/v1/models", timeout=10) as resp:
            assert [m["id"] for m in json.loads(resp.read())["data"]] == ["kvtest/tiny"]
        body = json.dumps({"model": "kvtest/tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0,
                           "ignore_eos": True}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 4
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
