"""Issue 4, test 5 (over the network): the owner's endpoints and notification drain reject malformed
input and stay up with bounded memory; a reader refuses malformed metadata; the shared token is enforced."""

from __future__ import annotations

import asyncio
import dataclasses
import resource
import socket
import time

import msgpack
import pytest
from aiohttp import web
from kvrelay.transfer.config import TOKEN_HEADER
from kvrelay.transfer.errors import PeerMismatchError, TransferError
from kvrelay.transfer.metadata import PROTOCOL_VERSION
from kvrelay.transfer.wire import decode_meta, encode_lease_request, encode_meta, encode_notif, encode_renew_request

from tests.transfer.harness import TOKEN, in_thread, open_reader, run, tokens
from tests.transfer.test_wire import META, malformed


def test_endpoints_require_the_shared_token(owner):
    assert owner.get("/kv/meta")[0] == 401
    assert owner.get("/kv/meta", {TOKEN_HEADER: "wrong"})[0] == 401
    status, body = owner.get("/kv/meta", {TOKEN_HEADER: TOKEN})
    assert status == 200 and decode_meta(body).agent_name == "owner-shared"
    assert owner.post("/kv/lease/renew", encode_lease_request("ab"), {TOKEN_HEADER: ""})[0] == 401


def test_malformed_renew_bodies_are_rejected_and_the_owner_stays_up_with_bounded_memory(owner, tmp_path):
    hwm_before = owner.state()["hwm_kib"]
    for name, payload in malformed(tmp_path).items():
        status, _ = owner.post("/kv/lease/renew", payload)
        assert status in (400, 413), (name, status)
    assert owner.post("/kv/lease/renew", encode_renew_request("0" * 32, b"\x00" * 32))[0] == 404  # unknown lease
    assert owner.post("/kv/lease/renew", encode_lease_request("0" * 32))[0] == 400  # no binding

    # A 4 GiB Content-Length with a few bytes behind it: refused before reading.
    with socket.create_connection(("127.0.0.1", owner.port), timeout=10) as sock:
        sock.sendall(b"POST /kv/lease/renew HTTP/1.1\r\nHost: x\r\nContent-Length: 4294967296\r\n"
                     + f"{TOKEN_HEADER}: {TOKEN}\r\n\r\n".encode() + b"\x00" * 64)
        assert sock.recv(64).startswith(b"HTTP/1.1 413")

    assert not (tmp_path / "pwned").exists()
    assert owner.alive() and owner.get("/kv/meta", {TOKEN_HEADER: TOKEN})[0] == 200
    assert owner.state()["hwm_kib"] - hwm_before < 64 * 1024


def test_malformed_notifications_are_dropped_and_counted(owner, tmp_path):
    async def body():
        async with open_reader() as r:
            handle = await in_thread(lambda: owner.offer(tokens(20, 2)))
            link = await r.peers.link(handle, timeout_s=10)
            before = await in_thread(owner.state)
            bad = [p for p in malformed(tmp_path).values() if len(p) < 60_000]  # NIXL notifications are small
            bad += [msgpack.packb({"v": PROTOCOL_VERSION, "kind": "steal", "lease_id": handle.lease_id}),
                    msgpack.packb({"v": PROTOCOL_VERSION, "kind": "done", "lease_id": 7})]
            for payload in bad:
                assert await r.agent.send_notif(link.name, payload)
            assert await r.agent.send_notif(link.name, encode_notif("done", "f" * 32))  # unknown lease: ignored
            await asyncio.sleep(0)
            deadline = time.monotonic() + 10
            while (await in_thread(owner.state))["notifs"] < before["notifs"] + len(bad) + 1:
                assert time.monotonic() < deadline, "owner did not drain the notifications"
                await asyncio.sleep(0.01)
            state = await in_thread(owner.state)
            assert state["bad_notifs"] - before["bad_notifs"] == len(bad)
            assert state["leases"] == 1 and not (tmp_path / "pwned").exists()
            result = await r.puller.pull(handle, deadline_s=10)  # the lease survived the garbage
            r.pool.release(result.block_ids)

    run(body())


class FakeOwner:
    """An aiohttp server on a free loopback port answering /kv/meta with whatever a test sets."""

    def __init__(self) -> None:
        self.status = 200
        self.body = b""
        self.stall = False
        self.unstall = asyncio.Event()

    async def meta(self, request: web.Request) -> web.StreamResponse:
        if self.stall:
            await self.unstall.wait()
        return web.Response(status=self.status, body=self.body)

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/kv/meta", self.meta)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return f"http://127.0.0.1:{self.runner.addresses[0][1]}"


def test_reader_refuses_malformed_metadata_and_stalled_owners_within_bounds(tmp_path, owner):
    async def body():
        fake = FakeOwner()
        url = await fake.start()
        async with open_reader() as r:
            handle = dataclasses.replace(await in_thread(lambda: owner.offer(tokens(21, 2))), owner_url=url)
            maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            cases = {**malformed(tmp_path), "6 MiB body": b"\x00" * (6 << 20)}
            for name, payload in cases.items():
                fake.body = payload
                with pytest.raises(TransferError) as err:
                    await r.puller.pull(handle, deadline_s=5)
                assert err.value.reason == "handshake", (name, err.value)
            fake.status, fake.body = 500, b"boom"
            with pytest.raises(TransferError, match="answered 500: boom"):
                await r.puller.pull(handle, deadline_s=5)
            newer = PROTOCOL_VERSION + 1
            fake.status, fake.body = 200, _with_version(newer)
            with pytest.raises(PeerMismatchError, match=f"protocol v{newer}, this node v{PROTOCOL_VERSION}"):
                await r.puller.pull(handle, deadline_s=5)
            fake.stall = True
            t0 = time.monotonic()
            with pytest.raises(TransferError, match="did not finish within 0.5s"):
                await r.puller.pull(handle, deadline_s=0.5)
            assert time.monotonic() - t0 < 2
            assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - maxrss < 64 * 1024
            assert r.pool.num_free_blocks == r.pool.num_blocks and r.peers.cached(url) is None
            assert not (tmp_path / "pwned").exists()
        fake.unstall.set()
        await fake.runner.cleanup()
        await in_thread(lambda: owner.post("/kv/lease/renew", b""))  # still up
        # Let the real lease go: the owner fixture checks its pins drop to zero.
        async with open_reader() as r:
            real = dataclasses.replace(handle, owner_url=owner.url)
            r.pool.release((await r.puller.pull(real, deadline_s=10)).block_ids)

    run(body())


def release_lease(owner, lease_id: str) -> bool:
    """What the router does with a handle's open lease: POST /kv/lease/release; whether it was held."""
    from kvrelay.transfer.wire import decode_release_reply

    status, body = owner.post("/kv/lease/release", encode_lease_request(lease_id))
    assert status == 200, (status, body)
    return decode_release_reply(body)


def _with_version(version: int) -> bytes:
    raw = msgpack.unpackb(encode_meta(META))
    raw["v"] = version
    return msgpack.packb(raw)


def test_release_drops_a_lease_once_and_checks_its_body(owner, tmp_path):
    from kvrelay.transfer.wire import decode_release_reply

    handle = owner.offer(tokens(20, 3))
    before = owner.state()
    assert owner.post("/kv/lease/release", encode_lease_request(handle.lease_id), {TOKEN_HEADER: ""})[0] == 401
    status, body = owner.post("/kv/lease/release", encode_lease_request(handle.lease_id))
    assert status == 200 and decode_release_reply(body) is True
    after = owner.state()
    assert after["leases"] == before["leases"] - 1
    assert after["pinned_refs"] == before["pinned_refs"] - len(handle.blocks) and after["integrity"] == "ok"
    status, body = owner.post("/kv/lease/release", encode_lease_request(handle.lease_id))
    assert status == 200 and decode_release_reply(body) is False  # already gone: nothing changes
    assert owner.post("/kv/lease/renew", encode_renew_request(handle.lease_id, handle.binding))[0] == 404
    for name, payload in malformed(tmp_path).items():
        assert owner.post("/kv/lease/release", payload)[0] in (400, 413), name
    assert owner.alive()


def test_renew_confirms_only_the_handle_the_lease_was_granted_for(owner):
    """Issue 30, failure mode 4: the owner answers a renewal naming its handle's binding with 200 and one
    naming the binding of an altered handle (other block ids, other digests, no digests) with 409."""
    a, b = owner.offer(tokens(21, 3)), owner.offer(tokens(22, 3))
    renew = "/kv/lease/renew"
    assert owner.post(renew, encode_renew_request(a.lease_id, a.binding))[0] == 200
    for altered in (dataclasses.replace(a, blocks=b.blocks), dataclasses.replace(a, digests=b.digests),
                    dataclasses.replace(a, digests=())):
        status, body = owner.post(renew, encode_renew_request(a.lease_id, altered.binding))
        assert status == 409 and f"lease {a.lease_id} pins other blocks for these keys" in body.decode()
    assert owner.post(renew, encode_renew_request(b.lease_id, a.binding))[0] == 409  # another lease's handle
    for handle in (a, b):
        assert release_lease(owner, handle.lease_id)
