"""An owner (prefill-side) node for the transfer tests, run as its own process:

    python -m tests.transfer.owner_proc --name owner-a [--port P] [--token T] [--model-fp X] [--ttl 30]

It registers a ``device`` and a ``host`` pool with a real `KvAgent`, serves the real transfer routes
(`transfer.server`) on 127.0.0.1 and prints one JSON line ``{"port", "pid", "agent", "incarnation"}``
once it is ready. Two test-only routes drive it:

    POST /test/offer  {"tokens": [...], "tier": "device"|"host"|"split", "digests"?: [...]}  → encoded KvHandle
                      (blocks are filled with `expected_block(key)` the first time a key is seen; the
                      handle carries their digests, or the ``digests`` given)
    GET  /test/state  → {"leases", "pinned_refs", "integrity", "notifs", "bad_notifs", "reaped",
                         "rss_kib", "hwm_kib"}
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import signal
import sys

import msgpack
import torch
from aiohttp import web
from kvrelay.kvstore.block_key import BlockKey, block_keys
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.digest import block_digest
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.lease import LeaseTable, TierBlock
from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.owner import KvOwner
from kvrelay.transfer.server import add_transfer_routes, bind_socket, start_server
from kvrelay.transfer.wire import encode_handle

OWNER_BLOCKS = 640  # 80 MiB of 128 KiB blocks


def make_spec(model_fp: str = "tiny-test") -> BlockSpec:
    """128 KiB float32 blocks: 4 layers × 4 kv heads × 16 tokens × 64 dims × 2 (k|v)."""
    return BlockSpec(num_layers=4, num_kv_heads=4, head_dim=64, block_size_tokens=16, dtype="float32",
                     model_fingerprint=model_fp)


def expected_block(spec: BlockSpec, key: BlockKey) -> torch.Tensor:
    """The bytes an owner stores under ``key``, as int32 words (compare bit-exactly, NaNs included)."""
    words = spec.block_bytes // 4
    seed = int.from_bytes(key[:4], "little", signed=True)
    return torch.arange(words, dtype=torch.int32).mul_(-1640531535).bitwise_xor_(seed)


def words_of(block: torch.Tensor) -> torch.Tensor:
    return block.contiguous().view(torch.int32).reshape(-1)


class OwnerNode:
    def __init__(self, spec: BlockSpec, owner: KvOwner, tier_to_pool: dict[str, BlockPool]) -> None:
        self.spec = spec
        self.owner = owner
        self.tier_to_pool = tier_to_pool

    def _ensure(self, tier: str, keys: list[BlockKey]) -> list[int]:
        """Block ids on ``tier`` holding ``keys`` (filled and keyed on first sight), each acquired once."""
        pool = self.tier_to_pool[tier]
        tensor = self.owner.agent.pool(tier)
        out: list[int] = []
        for key in keys:
            block_id = pool.block_id_of(key)
            if block_id is not None:
                pool.acquire([block_id])
            else:
                block_id = pool.allocate(1)[0]
                words_of(tensor[block_id]).copy_(expected_block(self.spec, key))
                assert pool.register_key(block_id, key)
            out.append(block_id)
        return out

    async def offer(self, request: web.Request) -> web.Response:
        msg = msgpack.unpackb(await request.read())
        keys = block_keys(msg["tokens"], block_size_tokens=self.spec.block_size_tokens,
                          spec_fingerprint=self.spec.fingerprint)
        tier = msg.get("tier", "device")
        if tier == "split":  # first half on device, the rest on host
            half = len(keys) // 2
            blocks = [TierBlock("device", b) for b in self._ensure("device", keys[:half])]
            blocks += [TierBlock("host", b) for b in self._ensure("host", keys[half:])]
        else:
            blocks = [TierBlock(tier, b) for b in self._ensure(tier, keys)]
        digests = msg.get("digests") or [block_digest(k, expected_block(self.spec, k)) for k in keys]
        handle = self.owner.offer(keys, blocks, num_tokens=len(keys) * self.spec.block_size_tokens, digests=digests)
        for t, b in blocks:  # the lease holds them now
            self.tier_to_pool[t].release([b])
        return web.Response(body=encode_handle(handle))

    async def state(self, request: web.Request) -> web.Response:
        try:
            for pool in self.tier_to_pool.values():
                pool.check_integrity()
            self.owner.check_integrity()
            integrity = "ok"
        except AssertionError as exc:
            integrity = f"FAILED: {exc}"
        status = dict(line.split(":", 1) for line in open(f"/proc/{os.getpid()}/status") if ":" in line)
        return web.Response(body=msgpack.packb({
            "leases": self.owner.leases.num_leases,
            "pinned_refs": sum(pool.ref_count(b) for pool in self.tier_to_pool.values()
                               for b in range(pool.num_blocks)),
            "integrity": integrity, "notifs": self.owner.num_notifs, "bad_notifs": self.owner.num_bad_notifs,
            "reaped": self.owner.num_reaped, "rss_kib": int(status["VmRSS"].split()[0]),
            "hwm_kib": int(status["VmHWM"].split()[0]),
        }))


async def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None)
    parser.add_argument("--model-fp", default="tiny-test")
    parser.add_argument("--ttl", type=float, default=30.0)
    args = parser.parse_args(argv)
    spec = make_spec(args.model_fp)
    config = TransferConfig(agent_name=args.name, lease_ttl_s=args.ttl, internal_token=args.token,
                            reap_interval_s=0.05)
    tier_to_pool = {"device": BlockPool(OWNER_BLOCKS), "host": BlockPool(OWNER_BLOCKS // 4)}
    agent = KvAgent(args.name, spec, [("device", spec.new_pool(OWNER_BLOCKS)),
                                      ("host", spec.new_pool(OWNER_BLOCKS // 4))])
    sock = bind_socket(port=args.port)
    port = sock.getsockname()[1]
    owner = KvOwner(agent, LeaseTable(tier_to_pool), owner_url=f"http://127.0.0.1:{port}", config=config)
    node = OwnerNode(spec, owner, tier_to_pool)
    app = web.Application()
    add_transfer_routes(app, owner)
    app.router.add_post("/test/offer", node.offer)
    app.router.add_get("/test/state", node.state)
    runner = await start_server(app, sock)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print(json.dumps({"port": port, "pid": os.getpid(), "agent": args.name, "incarnation": agent.incarnation}),
          flush=True)
    await stop.wait()
    await runner.cleanup()
    agent.close()


def die_with_parent() -> None:
    """Linux: get SIGKILL when our parent dies, so no owner outlives its test run. The signal follows
    the parent *thread*: start these processes from the test's main thread, not from an executor."""
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


if __name__ == "__main__":
    die_with_parent()
    asyncio.run(main(sys.argv[1:]))
