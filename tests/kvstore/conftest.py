"""Fixtures of the tiered-store tests: factories that run `check_integrity()` of every tier after each
test (issue 3, test 6) and close what they opened."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.lmdb_tier import LmdbOptions, LmdbTier
from kvrelay.kvstore.tiered_store import TieredStore, TieredStoreConfig

from tests.kvstore.store_helpers import SPEC


@pytest.fixture
def make_store(tmp_path: Path) -> Iterator[Callable[..., TieredStore]]:
    """``make_store(num_device_blocks=…, num_host_blocks=…, disk=True, **config)``; checked and closed after."""
    stores: list[TieredStore] = []

    def make(*, disk: bool = False, disk_capacity_bytes: int = 1 << 20, **kwargs: object) -> TieredStore:
        on_move = kwargs.pop("on_move", None)
        config = TieredStoreConfig(
            disk_path=str(tmp_path / "kv") if disk else None, disk_capacity_bytes=disk_capacity_bytes,
            **kwargs,  # type: ignore[arg-type]
        )
        store = TieredStore(SPEC, config, on_move=on_move)  # type: ignore[arg-type]
        stores.append(store)
        return store

    yield make
    for store in stores:
        if not store.closed:
            store.check_integrity()
            store.close()


@pytest.fixture
def make_disk(tmp_path: Path) -> Iterator[Callable[..., LmdbTier]]:
    """``make_disk(capacity_bytes=…, options=…, path=…)``; checked and closed after the test."""
    tiers: list[LmdbTier] = []

    def make(*, capacity_bytes: int = 1 << 20, options: LmdbOptions | None = None, path: Path | None = None,
             spec: BlockSpec = SPEC) -> LmdbTier:
        tier = LmdbTier(spec, path or tmp_path / "kv", capacity_bytes=capacity_bytes,
                        options=options or LmdbOptions())
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        if not tier.closed:
            tier.check_integrity()
            tier.close()
