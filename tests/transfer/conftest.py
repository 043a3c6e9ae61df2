"""Fixtures of the transfer tests: owner processes that are integrity-checked after every test
(issue 4, test 6) and stopped at the end. Readers check themselves on leaving `open_reader`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.transfer.harness import OwnerProc, wait_until


@pytest.fixture(scope="module")
def shared_owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnerProc]:
    """One owner (token-protected) shared by a module's tests; each test leaves it with no leases."""
    owner = OwnerProc("owner-shared", tmp_path_factory.mktemp("owner-logs"))
    yield owner
    owner.stop()


@pytest.fixture
def owner(shared_owner: OwnerProc) -> Iterator[OwnerProc]:
    """The shared owner; after the test its pins must drop to zero and its integrity check pass."""
    yield shared_owner
    wait_until(lambda: shared_owner.state()["pinned_refs"] == 0, 10, "the shared owner's pins to drop to zero")
    state = shared_owner.state()
    assert state["leases"] == 0
    assert state["integrity"] == "ok", state["integrity"]


@pytest.fixture
def start_owner(tmp_path: Path) -> Iterator[Callable[..., OwnerProc]]:
    """``start_owner(name, **kwargs)`` → a fresh owner process; checked (if alive) and stopped after the test."""
    owners: list[OwnerProc] = []

    def start(name: str, **kwargs: object) -> OwnerProc:
        proc = OwnerProc(name, tmp_path, **kwargs)  # type: ignore[arg-type]
        owners.append(proc)
        return proc

    yield start
    try:
        for proc in owners:
            if proc.alive():
                proc.check_integrity()
    finally:
        for proc in owners:
            proc.stop()
