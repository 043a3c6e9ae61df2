"""Issue 64: a model by hub repo id (``model.hub``), read by the real ``huggingface_hub`` from a hub cache laid out
on disk by the test (`tests.hub_cache`). These run in offline mode (``tests/conftest.py`` sets HF_HUB_OFFLINE=1
before ``huggingface_hub`` is imported); `tests/deploy/test_hub_cli.py` runs the online, unreachable case."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import IncompleteSnapshotError
from kvrelay.model.hub import ALLOW_PATTERNS, HubError, ModelSource, is_hub_id, resolve_model
from kvrelay.model.loader import model_fingerprint

from tests.hub_cache import COMMIT, NOT_FETCHED, write_hub_snapshot


def test_offline_mode_is_on_in_this_process():
    assert constants.HF_HUB_OFFLINE is True  # what every test below relies on


@pytest.mark.parametrize(("name", "is_id"), [
    ("Qwen/Qwen3-8B", True), ("meta-llama/Llama-3.1-8B-Instruct", True), ("kvtest/tiny", True), ("a_b/c.d", True),
    (".models/smollm2-135m-instruct", False),  # the shipped config's path: a local path, even when absent
    ("gpt2", False), ("a/b/c", False), ("/models/x", False), ("~/x", False), ("./x", False), ("org/-x", False),
    ("org/x.", False), ("a--b/c", False), ("a/b..c", False), ("org/x.git", False), ("org/na me", False),
    ("o/" + "x" * 95, False),
])
def test_is_hub_id_takes_org_slash_name_as_the_hub_validates_it(name, is_id):
    assert is_hub_id(name) is is_id


def test_a_local_path_wins_over_the_hub_and_a_missing_non_id_is_returned_as_given(tmp_path, tiny_model_dir,
                                                                                   monkeypatch):
    monkeypatch.chdir(tmp_path)
    hub = tmp_path / "hub"
    write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    shutil.copytree(tiny_model_dir, tmp_path / "kvtest" / "tiny")
    assert resolve_model("kvtest/tiny", download_dir=hub) == ModelSource(Path("kvtest/tiny"))
    assert resolve_model(tmp_path / "kvtest" / "tiny") == ModelSource(tmp_path / "kvtest" / "tiny")
    assert resolve_model("gpt2") == ModelSource(Path("gpt2"))  # not an id: the loader reports the missing directory
    assert resolve_model("no/such/dir") == ModelSource(Path("no/such/dir"))


def test_a_repo_id_resolves_to_its_snapshot_in_the_hub_cache(tmp_path, tiny_model_dir, capsys):
    hub = tmp_path / "hub"
    snapshot = write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    want = ModelSource(snapshot, repo_id="kvtest/tiny", revision=COMMIT)
    assert resolve_model("kvtest/tiny", download_dir=hub) == want
    assert capsys.readouterr().err == (f"kvrelay: fetching model 'kvtest/tiny' from the hub cache only "
                                       f"(HF_HUB_OFFLINE is set) into {hub}\n")
    assert resolve_model("kvtest/tiny", revision=COMMIT, download_dir=hub) == want  # a commit needs no ref
    assert model_fingerprint(snapshot) == model_fingerprint(tiny_model_dir)  # the same weights, the same KV
    # The cached tree lists files kvrelay never reads (NOT_FETCHED): without its allow_patterns the same snapshot
    # is incomplete, so the patterns are what keeps a download to the files the loader needs.
    assert not any(any(Path(f).match(p) for p in ALLOW_PATTERNS) for f in NOT_FETCHED)
    with pytest.raises(IncompleteSnapshotError):
        snapshot_download("kvtest/tiny", cache_dir=hub)


def test_a_repo_id_missing_from_the_offline_cache_names_the_model_and_what_to_do(tmp_path, tiny_model_dir):
    hub = tmp_path / "hub"
    write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    with pytest.raises(HubError) as err:
        resolve_model("kvtest/missing", download_dir=hub)
    assert str(err.value) == (
        f"model 'kvtest/missing' is not in the hub cache {hub} and HF_HUB_OFFLINE is set: download it first "
        "(`hf download kvtest/missing` on a machine with access, into this cache, or pass --download-dir), or unset "
        "HF_HUB_OFFLINE")
    with pytest.raises(HubError, match=r"^model 'kvtest/tiny' at revision 'v2' is not in the hub cache "):
        resolve_model("kvtest/tiny", revision="v2", download_dir=hub)  # no refs/v2


def test_a_snapshot_missing_a_file_the_loader_reads_is_named_incomplete(tmp_path, tiny_model_dir):
    hub = tmp_path / "hub"
    snapshot = write_hub_snapshot(hub, "kvtest/tiny", tiny_model_dir)
    (snapshot / "tokenizer.json").unlink()  # listed in the cached tree, gone from the snapshot: a cut download
    with pytest.raises(HubError) as err:
        resolve_model("kvtest/tiny", download_dir=hub)
    assert str(err.value) == (
        f"model 'kvtest/tiny': its snapshot in the hub cache {hub} misses files kvrelay reads (an interrupted "
        "download) and the hub could not complete it: run again with the hub reachable (unset HF_HUB_OFFLINE), or "
        "`hf download kvtest/tiny`")


def test_a_snapshot_without_config_json_is_not_a_model(tmp_path, tiny_model_dir):
    model = tmp_path / "no-config"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").unlink()
    hub = tmp_path / "hub"
    snapshot = write_hub_snapshot(hub, "kvtest/noconfig", model)
    with pytest.raises(HubError) as err:
        resolve_model("kvtest/noconfig", download_dir=hub)
    assert str(err.value) == (f"model 'kvtest/noconfig': the snapshot {snapshot} has no config.json; it is not a "
                              "Transformers model repo")
