"""The Mooncake conversation trace ships with the repository, unchanged, and the replay finds it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from kvrelay.benchmarks.common import DEFAULT_TRACE, find_trace, read_trace

SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_shipped_trace_is_the_published_file() -> None:
    data = DEFAULT_TRACE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == SHA256
    assert SHA256 in (DEFAULT_TRACE.parent / "README.md").read_text()  # the README states the same checksum
    lines = data.decode().splitlines()
    assert len(lines) == 12031
    first = json.loads(lines[0])
    assert set(first) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert len(first["hash_ids"]) == -(-first["input_length"] // 512) and first["hash_ids"][0] == 0


def test_find_trace_prefers_the_argument_then_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVRELAY_TRACE", raising=False)
    assert find_trace() == DEFAULT_TRACE
    other = tmp_path / "t.jsonl"
    other.write_text('{"timestamp": 5, "input_length": 600, "output_length": 3, "hash_ids": [0, 9]}\n')
    monkeypatch.setenv("KVRELAY_TRACE", str(other))
    assert find_trace() == other
    assert [r.hash_ids for r in read_trace()] == [(0, 9)]
    assert find_trace(str(DEFAULT_TRACE)) == DEFAULT_TRACE
    monkeypatch.setenv("KVRELAY_TRACE", str(tmp_path / "missing.jsonl"))
    with pytest.raises(FileNotFoundError, match=r"missing.jsonl \(KVRELAY_TRACE\) does not exist"):
        find_trace()
    with pytest.raises(FileNotFoundError, match=r"nope.jsonl \(--trace\) does not exist"):
        find_trace(str(tmp_path / "nope.jsonl"))
