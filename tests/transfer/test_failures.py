"""Issue 4, tests 2–4: killed and stopped peers, a restarted owner, a fingerprint mismatch.

Reads that must be caught mid-flight are made deterministic with SIGSTOP: a stopped owner's UCX
worker cannot acknowledge the READ, so it stays in flight (state PROC) until SIGCONT or SIGKILL.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time

import pytest
from kvrelay.transfer.errors import PeerMismatchError, TransferError
from kvrelay.transfer.wire import encode_handle

from tests.transfer.harness import (
    REPO,
    SPEC,
    TOKEN,
    HeldCompletions,
    LineReader,
    await_until,
    in_thread,
    keys_of,
    open_reader,
    pause_owner_once_renewed,
    run,
    tokens,
    wait_until,
)
from tests.transfer.owner_proc import make_spec


def test_reader_killed_before_reading_owner_unpins_at_lease_expiry(start_owner):
    reader = subprocess.Popen(  # starts while the owner starts
        [sys.executable, "-m", "tests.transfer.reader_proc", TOKEN], cwd=REPO,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    lines = LineReader(reader, None)
    try:
        owner = start_owner("owner-ttl", ttl_s=3.0)
        assert lines.next_json(60, "the reader to start") == {"ready": True}
        handle = owner.offer(tokens(10, 6))
        reader.stdin.write(encode_handle(handle).hex() + "\n")
        reader.stdin.flush()
        assert lines.next_json(60, "the reader to link") == {"linked": True}
        reader.send_signal(signal.SIGKILL)
        reader.wait(timeout=10)
        assert owner.state()["pinned_refs"] == 6  # nobody told the owner anything
        wait_until(lambda: owner.state()["pinned_refs"] == 0, 15, "the lease to expire")
        state = owner.state()
        assert (state["leases"], state["reaped"], state["notifs"]) == (0, 1, 0)

        async def late_reader():
            async with open_reader() as r:
                with pytest.raises(TransferError, match="no longer holds lease") as err:
                    await r.puller.pull(handle, deadline_s=10)
                assert err.value.reason == "lease_lost"
                assert await r.puller.wait_quarantine_drained(10)  # the READ may have been in flight
                assert r.pool.num_free_blocks == r.pool.num_blocks  # nothing read is kept
                assert all(r.pool.block_id_of(k) is None for k in handle.keys)

        run(late_reader())
    finally:
        if reader.poll() is None:
            reader.kill()
        reader.wait()


async def _warm_pull(r, owner) -> None:
    """One small pull so the handshake and the UCX connection exist before the owner is stopped."""
    result = await r.puller.pull(await in_thread(lambda: owner.offer(tokens(99, 1))), deadline_s=20)
    r.pool.release(result.block_ids)


def test_owner_killed_during_a_read_raises_within_the_deadline_and_frees_blocks(start_owner):
    owner = start_owner("owner-doomed")

    async def body():
        async with open_reader() as r:
            await _warm_pull(r, owner)
            handle = await in_thread(lambda: owner.offer(tokens(11, 512)))  # 64 MiB
            free_before = r.pool.num_free_blocks
            pause_owner_once_renewed(r, owner)
            task = asyncio.create_task(r.puller.pull(handle, deadline_s=30))
            await await_until(lambda: r.puller.num_reads_in_flight == 1, 10, "the READ to be posted")
            t_kill = time.monotonic()
            owner.signal(signal.SIGKILL)
            with pytest.raises(TransferError) as err:
                await task
            assert time.monotonic() - t_kill < 10  # far inside the 30 s deadline
            assert err.value.reason == "peer_gone", err.value
            assert r.puller.num_quarantined_blocks == 0
            assert r.pool.num_free_blocks == free_before
            assert all(r.pool.block_id_of(k) is None for k in keys_of(tokens(11, 512)))
            assert r.peers.cached(owner.url) is None  # the next pull handshakes again

    run(body())


def test_owner_stopped_deadline_fires_and_the_late_completion_is_ignored(start_owner):
    owner = start_owner("owner-stopped", ttl_s=3.0)

    async def body():
        async with open_reader(renew_timeout_s=0.5) as r:
            await _warm_pull(r, owner)
            toks = tokens(12, 64)
            handle = await in_thread(lambda: owner.offer(toks))
            free_before = r.pool.num_free_blocks
            pause_owner_once_renewed(r, owner)
            # UCX over CMA can finish a READ from a stopped owner; held, the puller sees it in flight every run.
            held = HeldCompletions(r)
            t0 = time.monotonic()
            with pytest.raises(TransferError) as err:
                await r.puller.pull(handle, deadline_s=1.0)
            elapsed = time.monotonic() - t0
            assert err.value.reason == "timeout", err.value
            assert 1.0 <= elapsed < 3.0
            # The READ is still in flight: its 64 blocks stay out of the pool, unkeyed, because NIXL may still
            # write them.
            assert r.puller.num_quarantined_blocks == 64
            assert r.pool.num_free_blocks == free_before - 64
            r.check_integrity()

            owner.signal(signal.SIGCONT)
            held.let_go()  # the late completion: the quarantine drains
            assert await r.puller.wait_quarantine_drained(15)
            assert r.puller.num_quarantined_blocks == 0
            assert r.pool.num_free_blocks == free_before
            assert all(r.pool.block_id_of(k) is None for k in keys_of(toks))  # late bytes never keyed
            await await_until(lambda: owner.state()["leases"] == 0, 10, "the abort or expiry to unpin")

            result = await r.puller.pull(await in_thread(lambda: owner.offer(toks)), deadline_s=20)
            r.assert_holds(result.block_ids, keys_of(toks))
            r.pool.release(result.block_ids)

    run(body())


def test_owner_restarted_with_new_metadata_is_handshaken_again(start_owner):
    first = start_owner("owner-phoenix")

    async def body():
        async with open_reader() as r:
            old = await in_thread(lambda: first.offer(tokens(13, 4)))
            result = await r.puller.pull(old, deadline_s=20)
            r.pool.release(result.block_ids)
            assert r.peers.num_handshakes == 1
            await in_thread(first.stop)
            second = start_owner("owner-phoenix", port=first.port)  # not from a thread: see die_with_parent
            assert second.incarnation != first.incarnation

            toks = tokens(14, 8)
            fresh = await r.puller.pull(await in_thread(lambda: second.offer(toks)), deadline_s=20)
            assert r.peers.num_handshakes == 2
            r.assert_holds(fresh.block_ids, keys_of(toks))
            r.pool.release(fresh.block_ids)

            stale = await in_thread(lambda: first_handle_again(old))
            with pytest.raises(TransferError, match="owner restarted") as err:
                await r.puller.pull(stale, deadline_s=5)
            assert err.value.reason == "peer_gone"

    def first_handle_again(handle):
        # A handle issued before the restart, for keys the reader does not hold any more.
        from dataclasses import replace

        return replace(handle, keys=tuple(keys_of(tokens(15, 4))))

    run(body())


def test_fingerprint_mismatch_is_refused_naming_both_fingerprints(start_owner):
    owner = start_owner("owner-other-model", model_fp="another-model")
    theirs = make_spec("another-model").fingerprint.hex()
    ours = SPEC.fingerprint.hex()

    async def body():
        async with open_reader() as r:
            handle = await in_thread(lambda: owner.offer(tokens(16, 2)))
            free_before = r.pool.num_free_blocks
            with pytest.raises(PeerMismatchError) as err:
                await r.puller.pull(handle, deadline_s=10)
            assert theirs in str(err.value) and ours in str(err.value)
            assert err.value.reason == "mismatch"
            assert r.pool.num_free_blocks == free_before
            assert r.peers.cached(owner.url) is None

    run(body())


def test_two_owners_with_one_name_refuse_to_pair_until_one_is_gone(start_owner):
    """Issue 14: two live nodes started with one ``--name`` (their NIXL peers would keep replacing each
    other, cancelling READs) are refused by name, naming both URLs; once the first is gone, the second
    is a node that moved (a pod's new address) and pairs. A peer named like the reader itself is refused."""
    first = start_owner("owner-twin")
    second = start_owner("owner-twin")

    async def body():
        async with open_reader() as r:
            a = await r.puller.pull(await in_thread(lambda: first.offer(tokens(21, 3))), deadline_s=20)
            r.pool.release(a.block_ids)
            handle = await in_thread(lambda: second.offer(tokens(22, 3)))
            free_before = r.pool.num_free_blocks
            with pytest.raises(PeerMismatchError) as err:
                await r.puller.pull(handle, deadline_s=10)
            assert str(err.value) == (f"two nodes are named 'owner-twin': the one at {first.url} and the one at "
                                      f"{second.url}; give every node its own --name")
            assert r.pool.num_free_blocks == free_before and r.peers.cached(first.url) is not None
            await in_thread(first.stop)
            moved = await r.puller.pull(await in_thread(lambda: second.offer(tokens(23, 3))), deadline_s=20)
            r.assert_holds(moved.block_ids, keys_of(tokens(23, 3)))
            r.pool.release(moved.block_ids)
            assert r.peers.cached(first.url) is None

        async with open_reader() as r:
            r.agent.name = "owner-twin"  # this reader calls itself what the owner does
            with pytest.raises(PeerMismatchError, match="the node at .* is named 'owner-twin', as is this node"):
                await r.puller.pull(await in_thread(lambda: second.offer(tokens(24, 3))), deadline_s=10)

    run(body())
