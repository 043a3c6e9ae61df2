"""A Hugging Face Hub cache laid out on disk by the test, as ``huggingface_hub`` leaves one after a download.

    <hub>/models--ORG--NAME/
        refs/main                          the commit hash, no newline
        blobs/<sha256>                     each file's bytes, named by its hash
        snapshots/<commit>/<file>          -> ../../blobs/<sha256>  (relative symlinks)
        trees/<commit>.json                the repo's whole tree listing at the commit (format_version 1)

``<hub>`` is ``$HF_HOME/hub`` (``huggingface_hub.constants.HF_HUB_CACHE``) or a ``cache_dir`` / ``--download-dir``.
The tree listing names files that were not fetched (``NOT_FETCHED``): a snapshot read with the loader's
``allow_patterns`` is complete, one read without them is not (``IncompleteSnapshotError``).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"
NOT_FETCHED = {"pytorch_model.bin": b"torch pickle", "original/consolidated.00.pth": b"original weights"}


def write_hub_snapshot(hub: Path, repo_id: str, model_dir: Path, *, commit: str = COMMIT,
                       ref: str | None = "main") -> Path:
    """Copy the files of ``model_dir`` into ``hub`` as repo ``repo_id`` at ``commit`` (``refs/<ref>`` pointing
    at it unless ``ref`` is None); returns the snapshot directory."""
    org, name = repo_id.split("/")
    repo = hub / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    tree: dict[str, dict[str, object]] = {}
    for path in sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith(".")):
        data = path.read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / digest).write_bytes(data)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / digest)
        tree[path.name] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    for file, data in NOT_FETCHED.items():
        tree[file] = {"size": len(data), "blob_id": hashlib.sha1(data).hexdigest()}
    (repo / "trees").mkdir(exist_ok=True)
    (repo / "trees" / f"{commit}.json").write_text(json.dumps({"format_version": 1, "files": tree}))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
