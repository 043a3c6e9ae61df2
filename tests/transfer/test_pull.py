"""Issue 4, test 1: owner and reader in separate processes — byte-identical reads, pins back to zero
after the completion notification, and only missing keys read."""

from __future__ import annotations

import asyncio
import signal

import pytest
from kvrelay.transfer.errors import TransferError

from tests.transfer.harness import (
    SPEC,
    await_until,
    in_thread,
    keys_of,
    open_reader,
    pause_owner_once_renewed,
    run,
    tokens,
)


def test_pulled_blocks_are_byte_identical_and_owner_unpins_after_notification(owner):
    async def body():
        async with open_reader() as r:
            toks = tokens(1, 24)
            handle = await in_thread(lambda: owner.offer(toks))
            assert (await in_thread(owner.state))["pinned_refs"] == 24
            result = await r.puller.pull(handle, deadline_s=20)
            assert (result.num_read, result.num_held, result.bytes_read) == (24, 0, 24 * SPEC.block_bytes)
            assert len(set(result.block_ids)) == 24
            r.assert_holds(result.block_ids, keys_of(toks))
            assert [r.pool.ref_count(b) for b in result.block_ids] == [1] * 24
            assert [r.pool.key_of(b) for b in result.block_ids] == keys_of(toks)
            await await_until(lambda: owner.state()["pinned_refs"] == 0, 10, "owner pins to drop to zero")
            assert owner.state()["leases"] == 0
            r.pool.release(result.block_ids)

    run(body())


def test_only_missing_keys_are_read_and_a_held_prefix_is_not_pulled_again(owner):
    async def body():
        async with open_reader() as r:
            toks = tokens(2, 10)
            first = await r.puller.pull(await in_thread(lambda: owner.offer(toks[: 4 * SPEC.block_size_tokens])),
                                        deadline_s=20)
            assert (first.num_read, first.num_held) == (4, 0)
            r.pool.release(first.block_ids)  # cached now: still keyed in the reader's pool

            full = await r.puller.pull(await in_thread(lambda: owner.offer(toks)), deadline_s=20)
            assert (full.num_read, full.num_held, full.bytes_read) == (6, 4, 6 * SPEC.block_bytes)
            assert full.block_ids[:4] == first.block_ids
            r.assert_holds(full.block_ids, keys_of(toks))

            again = await r.puller.pull(await in_thread(lambda: owner.offer(toks)), deadline_s=20)
            assert (again.num_read, again.num_held, again.bytes_read) == (0, 10, 0)
            assert again.block_ids == full.block_ids
            assert [r.pool.ref_count(b) for b in full.block_ids] == [2] * 10
            r.pool.release(full.block_ids)
            r.pool.release(again.block_ids)
            await await_until(lambda: owner.state()["leases"] == 0, 10, "both leases to be released")

    run(body())


def test_blocks_on_two_owner_tiers_come_in_one_pull(owner):
    async def body():
        async with open_reader() as r:
            toks = tokens(3, 12)
            handle = await in_thread(lambda: owner.offer(toks, tier="split"))
            assert [b.tier for b in handle.blocks] == ["device"] * 6 + ["host"] * 6
            result = await r.puller.pull(handle, deadline_s=20)
            assert result.num_read == 12
            r.assert_holds(result.block_ids, keys_of(toks))
            r.pool.release(result.block_ids)

    run(body())


def test_a_large_pull_of_many_descriptors_is_byte_identical(owner):
    async def body():
        async with open_reader() as r:
            toks = tokens(4, 512)  # 64 MiB, 512 descriptors
            result = await r.puller.pull(await in_thread(lambda: owner.offer(toks)), deadline_s=60)
            assert result.num_read == 512
            r.assert_holds(result.block_ids, keys_of(toks))
            r.pool.release(result.block_ids)

    run(body())


def test_too_few_free_blocks_is_a_typed_error_and_reserves_nothing(owner):
    async def body():
        async with open_reader() as r:
            hog = r.pool.allocate(r.pool.num_blocks - 3)
            handle = await in_thread(lambda: owner.offer(tokens(5, 4)))
            with pytest.raises(TransferError, match="need 4 free KV blocks") as err:
                await r.puller.pull(handle, deadline_s=10)
            assert err.value.reason == "no_blocks"
            assert r.pool.num_free_blocks == 3
            r.pool.release(hog)
            # Issue 28: the refusal told the owner ("abort"), so the lease is gone within a second, not
            # pinned until its TTL; the handle cannot be pulled any more.
            assert err.value.lease_ended is True
            await await_until(lambda: owner.state()["leases"] == 0, 1.0, "the abort to unpin the lease")
            with pytest.raises(TransferError) as err:
                await r.puller.pull(handle, deadline_s=10)
            assert err.value.reason == "lease_lost"
            assert await r.puller.wait_quarantine_drained(10)
            # A pull with room succeeds and ends its lease with "done".
            result = await r.puller.pull(await in_thread(lambda: owner.offer(tokens(5, 4))), deadline_s=10)
            assert result.lease_ended is True
            await await_until(lambda: owner.state()["leases"] == 0, 1.0, "the done notification to unpin")
            r.pool.release(result.block_ids)

    run(body())


def test_a_cancelled_pull_gives_its_blocks_back_once_the_read_settles(owner):
    """The decode service bounds a pull with ``asyncio.wait_for``: cancellation must not leak blocks."""

    async def body():
        async with open_reader() as r:
            warm = await r.puller.pull(await in_thread(lambda: owner.offer(tokens(6, 1))), deadline_s=20)
            r.pool.release(warm.block_ids)
            handle = await in_thread(lambda: owner.offer(tokens(7, 32)))
            free_before = r.pool.num_free_blocks
            pause_owner_once_renewed(r, owner)
            try:
                task = asyncio.create_task(r.puller.pull(handle, deadline_s=30))
                await await_until(lambda: r.puller.num_reads_in_flight == 1, 10, "the READ to be posted")
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
                await await_until(lambda: r.puller.num_reads_in_flight == 0, 10, "the clean-up to run")
                assert r.puller.num_quarantined_blocks in (0, 32)
                r.check_integrity()
            finally:
                owner.signal(signal.SIGCONT)
            assert await r.puller.wait_quarantine_drained(15)
            assert r.pool.num_free_blocks == free_before
            assert all(r.pool.block_id_of(k) is None for k in keys_of(tokens(7, 32)))

    run(body())


class _Checker:
    """What `Puller` checks read blocks with (`puller.IntegrityChecker`; the tiered store in a node)."""

    def __init__(self, pool_tensor, mode: str = "all", sample_rate: float = 0.05) -> None:
        from kvrelay.kvstore.digest import IntegrityPolicy

        self.integrity = IntegrityPolicy(mode, sample_rate)
        self.pool_tensor = pool_tensor
        self.checked = 0
        self.failures: list[tuple[str, bytes, int]] = []

    def digest_device_blocks(self, block_ids, keys):
        from kvrelay.kvstore.digest import digest_keyed

        return digest_keyed(self.pool_tensor, block_ids, keys)

    def integrity_checked(self, where, num_blocks):
        self.checked += num_blocks

    def integrity_failure(self, where, key, detail, num_blocks=1):
        self.failures.append((where, key, num_blocks))


def test_a_read_block_failing_its_digest_keeps_only_the_verified_prefix(owner):
    """Issue 16: blocks 2 and 6 of 8 do not match the handle's digests and block 5 is held already: the pull
    returns blocks 0-1, keys nothing past them, gives the read blocks back unkeyed and the held one its ref."""
    from kvrelay.kvstore.digest import block_digest
    from kvrelay.transfer.puller import Puller

    from tests.transfer.harness import expected_block

    async def body():
        async with open_reader() as r:
            toks = tokens(7, 8)
            keys = keys_of(toks)
            [held] = r.pool.allocate(1)
            r.block_words(held).copy_(expected_block(SPEC, keys[5]))
            assert r.pool.register_key(held, keys[5])
            free_before = r.pool.num_free_blocks
            digests = [block_digest(k, expected_block(SPEC, k)) for k in keys]
            digests[2] ^= 1  # as if the owner's blocks 2 and 6 had changed after it digested them
            digests[6] ^= 1
            handle = await in_thread(lambda: owner.offer(toks, digests=digests))
            checker = _Checker(r.agent.pool("device"))
            puller = Puller(r.agent, r.pool, r.peers, config=r.puller._config, store=checker)
            result = await puller.pull(handle, deadline_s=20)
            assert (len(result.block_ids), result.num_read, result.num_held, result.num_bad) == (2, 7, 1, 2)
            assert [r.pool.key_of(b) for b in result.block_ids] == keys[:2]
            r.assert_holds(result.block_ids, keys[:2])
            assert [r.pool.block_id_of(k) for k in keys[2:5] + keys[6:]] == [None] * 5
            assert r.pool.block_id_of(keys[5]) == held and r.pool.ref_count(held) == 1
            assert checker.checked == 7 and checker.failures == [("nixl_read", keys[2], 2)]
            assert r.pool.num_free_blocks == free_before - 2  # only the kept prefix is held
            r.pool.release(result.block_ids + [held])
            await puller.aclose()
            await await_until(lambda: owner.state()["leases"] == 0, 10, "the lease to be released")

    run(body())


def _counting_reads(r) -> list[int]:
    """Spy on the reader's agent: the number of blocks of each READ it posts."""
    posted: list[int] = []
    read = r.agent.read

    async def counted(link, remote, local_tier, local_ids):
        posted.append(len(local_ids))
        return await read(link, remote, local_tier, local_ids)

    r.agent.read = counted
    return posted


def test_a_handle_naming_blocks_not_leased_for_its_keys_is_refused_before_the_read(owner):
    """Issue 30, failure mode 4: the owner leased A's blocks under lease A and B's under lease B. A handle with
    lease A, A's keys and digests but B's block ids (in range, pinned, real KV) is refused by the owner at
    the first renew — before any READ: nothing is keyed, every reserved block is free again, lease A ends
    ("abort") and lease B is untouched (its own handle still reads)."""
    import dataclasses

    async def body():
        async with open_reader() as r:
            a_toks, b_toks = tokens(40, 4), tokens(41, 4)
            a = await in_thread(lambda: owner.offer(a_toks))
            b = await in_thread(lambda: owner.offer(b_toks))
            posted = _counting_reads(r)
            free_before = r.pool.num_free_blocks
            with pytest.raises(TransferError) as err:
                await r.puller.pull(dataclasses.replace(a, blocks=b.blocks), deadline_s=20)
            assert err.value.reason == "bad_handle" and err.value.lease_ended
            assert f"lease {a.lease_id}" in str(err.value) and "not what the owner leased" in str(err.value)
            assert posted == []
            assert [r.pool.block_id_of(k) for k in keys_of(a_toks)] == [None] * 4
            assert r.pool.num_free_blocks == free_before
            await await_until(lambda: owner.state()["leases"] == 1, 10, "lease A to end")
            result = await r.puller.pull(b, deadline_s=20)
            assert posted == [4]
            r.assert_holds(result.block_ids, keys_of(b_toks))
            r.pool.release(result.block_ids)

    run(body())


def test_a_handle_without_digests_is_refused_while_integrity_is_on(owner):
    """Issue 30, failure mode 4: a reader that checks integrity refuses a handle that carries no digests
    (nothing could be checked) before contacting its owner, so the lease stays open for whoever forwarded
    the handle; with integrity off the same blocks are pulled."""
    import dataclasses

    from kvrelay.transfer.puller import Puller

    from tests.transfer.test_server import release_lease

    async def body():
        async with open_reader() as r:
            toks = tokens(42, 3)
            handle = await in_thread(lambda: owner.offer(toks))
            checker = _Checker(r.agent.pool("device"), "sampled", sample_rate=1.0)
            puller = Puller(r.agent, r.pool, r.peers, config=r.puller._config, store=checker)
            with pytest.raises(TransferError) as err:
                await puller.pull(dataclasses.replace(handle, digests=()), deadline_s=20)
            assert err.value.reason == "bad_handle" and not err.value.lease_ended
            assert "carries no block digests" in str(err.value) and "kvstore.integrity" in str(err.value)
            assert r.pool.block_id_of(keys_of(toks)[0]) is None and checker.checked == 0
            assert await in_thread(lambda: release_lease(owner, handle.lease_id))
            handle = await in_thread(lambda: owner.offer(toks))
            result = await puller.pull(handle, deadline_s=20)  # the owner's own handle, digests and all
            assert checker.checked == 3 and checker.failures == []
            r.assert_holds(result.block_ids, keys_of(toks))
            r.pool.release(result.block_ids)
            await puller.aclose()

    run(body())
