"""Issue 64: ``model.path: ORG/NAME`` in the YAML (`deploy.service_config`) and its resolution to one snapshot
directory (`deploy.model_source`), against a hub cache laid out by the test (offline: ``tests/conftest.py``)."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest
from kvrelay.deploy.config import load_config
from kvrelay.deploy.model_source import node_overrides, resolve_config_model
from kvrelay.deploy.service_config import ModelSection
from kvrelay.deploy.sizes import ConfigError

from tests.hub_cache import COMMIT, write_hub_snapshot


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def test_a_repo_id_stays_a_name_until_resolved_and_a_local_path_of_that_name_wins(tmp_path, tiny_model_dir,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(write(tmp_path, "model: {path: kvtest/tiny, revision: v1, download_dir: cache}\n"))
    assert config.model == ModelSection(path="kvtest/tiny", name="kvtest/tiny", dtype="auto", device="auto",
                                        revision="v1", download_dir=str(tmp_path / "cache"))
    shutil.copytree(tiny_model_dir, tmp_path / "kvtest" / "tiny")
    config = load_config(write(tmp_path, "model: {path: kvtest/tiny}\n"))
    assert (config.model.path, config.model.name) == (str(tmp_path / "kvtest" / "tiny"), "tiny")
    assert resolve_config_model(config) is config  # a directory: nothing to resolve
    config = load_config(write(tmp_path, "model: {path: .models/absent}\n"))  # not an id: a (missing) directory
    assert (config.model.path, config.model.name) == (str(tmp_path / ".models" / "absent"), "absent")


def test_resolving_gives_the_snapshot_keeps_the_served_name_and_is_passed_to_every_node(tmp_path, tiny_model_dir):
    hub = tmp_path / "hub"
    snapshot = write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    config = load_config(write(tmp_path, f"model: {{path: kvtest/tiny, download_dir: {hub}}}\n"))
    resolved = resolve_config_model(config)
    assert (resolved.model.path, resolved.model.name) == (str(snapshot), "kvtest/tiny")
    assert resolved.kvstore == config.kvstore and resolved.router == config.router
    assert node_overrides(resolved) == ["--model", str(snapshot), "--served-model-name", "kvtest/tiny"]
    # what a node started with those flags reads: the same directory, the same name, nothing left to resolve
    node = load_config(write(tmp_path, f"model: {{path: kvtest/tiny, download_dir: {hub}}}\n"),
                       model_path=str(snapshot), model_name="kvtest/tiny")
    assert (node.model.path, node.model.name) == (str(snapshot), "kvtest/tiny")
    assert resolve_config_model(node) is node
    named = load_config(write(tmp_path, f"model: {{path: kvtest/tiny, name: tiny, revision: {COMMIT}, "
                                        f"download_dir: {hub}}}\n"))
    assert (resolve_config_model(named).model.path, resolve_config_model(named).model.name) == (str(snapshot), "tiny")


def test_a_repo_id_that_cannot_be_resolved_is_a_config_error_naming_model_path(tmp_path, tiny_model_dir):
    hub = tmp_path / "hub"
    write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    config = load_config(write(tmp_path, f"model: {{path: kvtest/missing, download_dir: {hub}}}\n"))
    with pytest.raises(ConfigError) as err:
        resolve_config_model(config)
    assert str(err.value) == (
        f"model.path: model 'kvtest/missing' is not in the hub cache {hub} and HF_HUB_OFFLINE is set: download it "
        "first (`hf download kvtest/missing` on a machine with access, into this cache, or pass --download-dir), or "
        "unset HF_HUB_OFFLINE")
