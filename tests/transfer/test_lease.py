"""`LeaseTable`: pins under leases, renewal, idempotent release and the reaper, on an injected clock."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.lease import BindingMismatch, LeaseTable, TierBlock
from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.owner import KvOwner
from kvrelay.transfer.pool_call import PoolCalls

B = b"\x01" * 32  # a lease's binding (transfer.handle.binding_of); these tests grant and renew with one


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def keyed_pool(num_blocks: int, num_keyed: int) -> BlockPool:
    """A pool whose first ``num_keyed`` blocks are cached (keyed, ref 0)."""
    pool = BlockPool(num_blocks)
    ids = pool.allocate(num_keyed)
    for b in ids:
        assert pool.register_key(b, BlockKey(bytes([b]) * 32))
    pool.release(ids)
    return pool


def test_grant_renew_release_and_reap():
    clock = Clock()
    device, host = keyed_pool(8, 4), keyed_pool(4, 2)
    table = LeaseTable({"device": device, "host": host}, clock=clock)
    a = table.grant([TierBlock("device", 0), TierBlock("device", 1), TierBlock("host", 1)], ttl_s=10, binding=B)
    b = table.grant([TierBlock("device", 1)], ttl_s=2, binding=B)
    assert len(a) == 32 and a != b
    assert [device.ref_count(i) for i in range(4)] == [1, 2, 0, 0] and host.ref_count(1) == 1
    assert (table.num_leases, table.num_pinned_blocks) == (2, 4)
    table.check_integrity()

    clock.now += 1.5
    assert table.renew(b, binding=B) == 2  # b now expires at 103.5
    clock.now += 1.9
    assert table.reap() == []
    clock.now += 0.1
    assert table.reap() == [b]
    assert table.renew(b, binding=B) is None and table.release(b) is False
    assert [device.ref_count(i) for i in range(4)] == [1, 1, 0, 0]

    assert table.release(a) is True
    assert table.release(a) is False  # idempotent
    assert [device.ref_count(i) for i in range(4)] == [0] * 4 and host.ref_count(1) == 0
    assert device.stats().num_cached == 4  # unpinned blocks stay cached, still keyed
    assert table.num_leases == 0
    device.check_integrity()
    table.check_integrity()


def test_an_expired_lease_is_not_renewed_back_to_life():
    clock = Clock()
    pool = keyed_pool(4, 1)
    table = LeaseTable({"device": pool}, clock=clock)
    lease = table.grant([TierBlock("device", 0)], ttl_s=1, binding=B)
    clock.now += 1.0
    assert table.renew(lease, binding=B) is None
    assert pool.ref_count(0) == 0 and table.num_leases == 0


def test_grant_refuses_free_blocks_unknown_tiers_and_bad_ids_and_pins_nothing():
    pool = keyed_pool(4, 2)
    table = LeaseTable({"device": pool}, clock=Clock())
    with pytest.raises(ValueError, match="block 3 is free"):
        table.grant([TierBlock("device", 0), TierBlock("device", 1), TierBlock("device", 3)], ttl_s=5, binding=B)
    with pytest.raises(ValueError, match="no pool for tier 'disk'"):
        table.grant([TierBlock("disk", 0)], ttl_s=5, binding=B)
    with pytest.raises(ValueError, match="out of range"):
        table.grant([TierBlock("device", 4)], ttl_s=5, binding=B)
    with pytest.raises(ValueError, match="ttl must be positive"):
        table.grant([TierBlock("device", 0)], ttl_s=0, binding=B)
    assert [pool.ref_count(i) for i in range(4)] == [0] * 4
    assert table.num_leases == 0
    pool.check_integrity()


def test_check_integrity_catches_a_pin_released_behind_the_tables_back():
    pool = keyed_pool(4, 2)
    table = LeaseTable({"device": pool}, clock=Clock())
    table.grant([TierBlock("device", 0)], ttl_s=5, binding=B)
    pool.release([0])
    with pytest.raises(AssertionError, match="device block 0 is pinned by 1 leases but has 0 refs"):
        table.check_integrity()


def test_a_renewal_for_another_binding_is_refused_and_extends_nothing():
    """Issue 30, failure mode 4: the lease confirms only the handle it was granted for."""
    clock = Clock()
    table = LeaseTable({"device": keyed_pool(4, 2)}, clock=clock)
    lease = table.grant([TierBlock("device", 0)], ttl_s=2, binding=B)
    clock.now += 1.5
    with pytest.raises(BindingMismatch, match=f"lease {lease} pins other blocks for these keys"):
        table.renew(lease, binding=b"\x02" * 32)
    clock.now += 0.5
    assert table.reap() == [lease]  # the refused renewal did not extend it
    assert table.renew(lease, binding=B) is None


def test_renew_live_extends_only_a_lease_held_past_the_margin_and_leaves_the_rest_to_renew():
    clock = Clock()
    pool = keyed_pool(4, 2)
    table = LeaseTable({"device": pool}, clock=clock)
    lease = table.grant([TierBlock("device", 0)], ttl_s=10, binding=B)  # expires at 110
    clock.now += 5.0
    assert table.renew_live(lease, binding=B, margin_s=1.0) == 10  # now expires at 115
    assert table.get(lease).expires_at == 115.0
    assert table.renew_live(lease, binding=b"\x02" * 32, margin_s=1.0) is None  # another binding: `renew` decides
    assert table.renew_live("no-such-lease", binding=B, margin_s=1.0) is None
    clock.now = 114.0  # 1 s left: not past the margin, so not renewed here
    assert table.renew_live(lease, binding=B, margin_s=1.0) is None and table.get(lease).expires_at == 115.0
    clock.now = 115.0
    assert table.reap() == [lease] and pool.ref_count(0) == 0
    assert table.renew_live(lease, binding=B, margin_s=1.0) is None  # gone stays gone


def test_renew_live_reports_nothing_when_the_call_took_longer_than_the_margin():
    reads = iter([100.0, 105.0, 106.5])  # grant's clock read; then renew_live's two, 1.5 s apart (held off the CPU)
    table = LeaseTable({"device": keyed_pool(4, 2)}, clock=lambda: next(reads))
    lease = table.grant([TierBlock("device", 0)], ttl_s=10, binding=B)  # expires at 110
    # A reap on another thread may have listed it as expired meanwhile: the engine thread's `renew` decides.
    assert table.renew_live(lease, binding=B, margin_s=1.0) is None
    assert table.get(lease) is not None  # still held; its expiry only moved later


class _StalledPoolCalls:
    """Pool calls on an engine thread that is busy: `call` counts its calls and never returns."""

    def __init__(self) -> None:
        self.called = 0

    async def call(self, fn):  # noqa: ANN001, ANN202 - a PoolCall
        self.called += 1
        await asyncio.Event().wait()

    must_run = call


def test_the_owner_answers_a_live_renewal_without_waiting_for_the_engine_thread():
    stalled = _StalledPoolCalls()
    table = LeaseTable({"device": keyed_pool(4, 2)})
    owner = KvOwner(cast(KvAgent, None), table, owner_url="http://127.0.0.1:1",
                    config=TransferConfig(agent_name="owner", lease_ttl_s=30.0),
                    pool_calls=PoolCalls(stalled.call, stalled.must_run))
    lease = table.grant([TierBlock("device", 0)], ttl_s=30.0, binding=B)

    async def renewals() -> None:
        assert await asyncio.wait_for(owner.renew(lease, B), 1.0) == 30.0  # answered on the event loop
        assert stalled.called == 0
        # Another binding is the engine thread's to refuse (`LeaseTable.renew`): the owner waits for it.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(owner.renew(lease, b"\x02" * 32), 0.2)
        assert stalled.called == 1

    asyncio.run(renewals())
