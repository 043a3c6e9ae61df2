"""Helpers of the transfer tests: owner processes, an in-process reader, and deadline waits."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import select
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import torch
from kvrelay.kvstore.block_key import BlockKey, block_keys
from kvrelay.kvstore.block_pool import BlockPool
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.transfer.config import TOKEN_HEADER, TransferConfig
from kvrelay.transfer.handle import KvHandle
from kvrelay.transfer.nixl_agent import KvAgent
from kvrelay.transfer.peer_cache import PeerCache
from kvrelay.transfer.puller import Puller
from kvrelay.transfer.wire import decode_handle

from tests.transfer.owner_proc import expected_block, make_spec, words_of

REPO = Path(__file__).resolve().parents[2]
SPEC = make_spec()
TOKEN = "s3cret-token"
READER_BLOCKS = 768


def tokens(seed: int, num_blocks: int) -> list[int]:
    """A prompt of ``num_blocks`` full blocks; different seeds give different first blocks."""
    return [(seed * 1_000_003 + i * 7919) % 50_000 for i in range(num_blocks * SPEC.block_size_tokens)]


def keys_of(toks: list[int], spec: BlockSpec = SPEC) -> list[BlockKey]:
    return block_keys(toks, block_size_tokens=spec.block_size_tokens, spec_fingerprint=spec.fingerprint)


def wait_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    """Block until ``cond()`` holds; fail naming ``what`` after ``timeout_s`` (polls, never sleeps blind)."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        select.select([], [], [], 0.01)


async def await_until(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(0.005)


class LineReader:
    """Reads a child's stdout on a thread (NIXL's logger writes there too, so it must be drained) and
    hands out its JSON lines; other lines go to ``log``."""

    def __init__(self, proc: subprocess.Popen, log: Any) -> None:
        self._lines: queue.Queue[str] = queue.Queue()
        self._log = log
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            if line.startswith("{"):
                self._lines.put(line)
            elif self._log is not None:
                self._log.write(line)
        self._lines.put("")  # EOF

    def next_json(self, timeout_s: float, what: str) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}") from None
        assert line, f"the child exited while waiting for {what}"
        return json.loads(line)


class OwnerProc:
    """A `tests.transfer.owner_proc` child process."""

    def __init__(self, name: str, log_dir: Path, *, port: int = 0, token: str | None = TOKEN,
                 model_fp: str = "tiny-test", ttl_s: float = 30.0) -> None:
        self.name = name
        self.token = token
        args = [sys.executable, "-m", "tests.transfer.owner_proc", "--name", name, "--port", str(port),
                "--model-fp", model_fp, "--ttl", str(ttl_s)]
        if token is not None:
            args += ["--token", token]
        self._stderr = open(log_dir / f"{name}-{uuid.uuid4().hex[:6]}.log", "w")
        self.proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=self._stderr, text=True)
        self.lines = LineReader(self.proc, self._stderr)
        try:
            info = self.lines.next_json(60, f"owner {name} to start (see {self._stderr.name})")
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.port: int = info["port"]
        self.pid: int = info["pid"]
        self.incarnation: str = info["incarnation"]
        self.url = f"http://127.0.0.1:{self.port}"

    def _call(self, method: str, path: str, body: bytes | None = None) -> Any:
        req = urllib.request.Request(self.url + path, data=body, method=method)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return msgpack.unpackb(resp.read())

    def offer(self, toks: list[int], *, tier: str = "device", digests: list[int] | None = None) -> KvHandle:
        """Lease the blocks of ``toks``; the handle carries their digests (``digests``: these instead, as an
        owner whose digests are wrong would)."""
        body: dict[str, Any] = {"tokens": toks, "tier": tier}
        if digests is not None:
            body["digests"] = digests
        req = urllib.request.Request(self.url + "/test/offer", data=msgpack.packb(body), method="POST")
        with urllib.request.urlopen(req, timeout=10) as resp:
            return decode_handle(resp.read())

    def state(self) -> dict[str, Any]:
        return self._call("GET", "/test/state")

    def post(self, path: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        hdrs = {TOKEN_HEADER: self.token} if self.token else {}
        hdrs.update(headers or {})
        req = urllib.request.Request(self.url + path, data=body, method="POST", headers=hdrs)
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def get(self, path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        req = urllib.request.Request(self.url + path, method="GET", headers=headers or {})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def pause(self) -> None:
        """SIGSTOP, and wait until the kernel reports the process stopped (delivery is asynchronous)."""
        os.kill(self.pid, signal.SIGSTOP)
        wait_until(lambda: self._proc_state() == "T", 10, f"owner {self.name} to stop")

    def _proc_state(self) -> str:
        with open(f"/proc/{self.pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check_integrity(self) -> None:
        state = self.state()
        assert state["integrity"] == "ok", f"owner {self.name}: {state['integrity']}"

    def stop(self) -> None:
        if self.alive():
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@dataclass
class Reader:
    """A decode-side node in the test process: device pool, agent, peer cache and puller."""

    pool: BlockPool
    agent: KvAgent
    peers: PeerCache
    puller: Puller
    session: aiohttp.ClientSession

    def block_words(self, block_id: int) -> torch.Tensor:
        return words_of(self.agent.pool("device")[block_id])

    def assert_holds(self, block_ids: list[int], keys: list[BlockKey], spec: BlockSpec = SPEC) -> None:
        """Every block is byte-identical to what the owner stored under its key."""
        assert len(block_ids) == len(keys)
        for b, key in zip(block_ids, keys, strict=True):
            assert torch.equal(self.block_words(b), expected_block(spec, key)), f"block {b} differs"

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        self.puller.check_integrity()


@contextlib.asynccontextmanager
async def open_reader(*, token: str | None = TOKEN, spec: BlockSpec = SPEC, **config: Any) -> AsyncIterator[Reader]:
    """A reader; on exit checks pool and puller integrity, then closes everything."""
    cfg = TransferConfig(agent_name=f"reader-{uuid.uuid4().hex[:8]}", internal_token=token, **config)
    pool = BlockPool(READER_BLOCKS)
    agent = KvAgent(cfg.agent_name, spec, [("device", spec.new_pool(READER_BLOCKS))])
    session = aiohttp.ClientSession()
    peers = PeerCache(agent, session, config=cfg)
    reader = Reader(pool, agent, peers, Puller(agent, pool, peers, config=cfg), session)
    try:
        yield reader
        reader.check_integrity()
    finally:
        await reader.puller.aclose()
        await peers.close()
        await session.close()
        agent.close()


def pause_owner_once_renewed(r: Reader, owner: OwnerProc) -> None:
    """Stop ``owner`` (SIGSTOP) right after it answers ``r``'s next lease renewal, so that the pull, whose
    lease (and handle) the owner has just confirmed, posts its READ against a stopped owner: the puller
    reads nothing before that confirmation (`transfer.puller`, step 4)."""
    renew = r.peers.renew

    async def renew_then_pause(handle: KvHandle, *, timeout_s: float) -> float | None:
        ttl = await renew(handle, timeout_s=timeout_s)
        r.peers.renew = renew  # type: ignore[method-assign]
        await in_thread(owner.pause)
        return ttl

    r.peers.renew = renew_then_pause  # type: ignore[method-assign]


class HeldCompletions:
    """Test-side: until `let_go`, ``r``'s NIXL agent reports none of the READs posted from now on as finished (their
    state stays ``PROC``, as from a peer that has not answered yet), whether or not UCX completed them (over CMA it
    can complete a READ from a SIGSTOPped owner). After `let_go` NIXL is asked again, and its answer stands. The
    transfer is real; only when the puller learns of its end is held back."""

    def __init__(self, r: Reader) -> None:
        self.held = True
        agent = r.agent
        read, poll = agent.read, agent.poll

        async def held_read(*args: Any, **kwargs: Any) -> Any:
            xfers = await read(*args, **kwargs)
            for x in xfers:
                if self.held and x.state == "DONE":
                    x.state = "PROC"
            return xfers

        async def held_poll(xfers: Any) -> None:
            if not self.held:
                await poll(xfers)

        agent.read, agent.poll = held_read, held_poll  # type: ignore[method-assign]

    def let_go(self) -> None:
        self.held = False


async def in_thread(fn: Callable[[], Any]) -> Any:
    """Run a blocking test helper (owner control calls) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(coro)  # type: ignore[arg-type]
