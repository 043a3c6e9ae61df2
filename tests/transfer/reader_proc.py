"""A reader node that handshakes with an owner for a handle and then waits to be killed:

    python -m tests.transfer.reader_proc TOKEN

Prints ``{"ready": true}`` once started, then reads one line (an encoded handle, hex) from stdin and
prints ``{"linked": true}`` once the owner's NIXL metadata is loaded and the READ's blocks are
allocated (it is about to READ).
"""

from __future__ import annotations

import asyncio
import json
import sys

import aiohttp
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.transfer.config import TransferConfig
from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.peer_cache import PeerCache
from kvrelay.transfer.wire import decode_handle

from tests.transfer.owner_proc import die_with_parent, make_spec


async def main(token: str) -> None:
    spec = make_spec()
    config = TransferConfig(agent_name="reader-doomed", internal_token=token)
    agent = KvAgent(config.agent_name, spec, [("device", spec.new_pool(64))])
    pool = BlockPool(64)
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession() as session:
        print(json.dumps({"ready": True}), flush=True)
        handle = decode_handle(bytes.fromhex(await loop.run_in_executor(None, sys.stdin.readline)))
        peers = PeerCache(agent, session, config=config)
        await peers.link(handle, timeout_s=10)
        pool.allocate(handle.num_blocks)  # where the READ would land
        print(json.dumps({"linked": True}), flush=True)
        await loop.run_in_executor(None, sys.stdin.read)


if __name__ == "__main__":
    die_with_parent()
    asyncio.run(main(sys.argv[1]))
