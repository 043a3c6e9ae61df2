"""``kvrelay bench edges``: held header-less connections beside normal clients (issue 65, gap A).

A real deployment (1P1D, the tiny model, a fresh disk tier) runs at a fixed open-file limit (``--server-fds``,
soft and hard: the servers cannot raise it). The benchmark opens ``--held`` connections that send half a request
head and never finish it, then starts ``--clients`` normal completions (``max_tokens`` 8, one connection each,
spread evenly over ``--spread-s``) and reports:

* the normal requests by status code, and the slowest answer among the refused ones (429/503);
* the peak open descriptors of the router and of each node (``/proc/PID/fd``, sampled every 0.1 s);
* each node's ``times_down`` afterwards (the router's ``/health``, with the internal token);
* how the held connections ended: refused at once (503, over the cap), or closed by the header deadline (408),
  and the time from the last one opened until the server had closed every one of them (an upper bound: each is
  read only once all are open).

The normal clients start together with the flood of held connections.

The benchmark raises its own open-file limit (it holds every connection); never the servers'.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import selectors
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PARTIAL_HEAD = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"  # never ends


@dataclass(slots=True)
class HeldEnd:
    """How one held connection ended: the first line the server sent (empty: none) and when it closed."""

    head: str = ""
    closed_at: float | None = None


@dataclass(slots=True)
class FdPeaks:
    """Peak ``/proc/PID/fd`` counts per process name, sampled by `sample` until `stop` is set."""

    pids: dict[str, int]
    peaks: dict[str, int] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        while not self.stop.is_set():
            for name, pid in self.pids.items():
                try:
                    n = len(os.listdir(f"/proc/{pid}/fd"))
                except OSError:
                    continue
                self.peaks[name] = max(self.peaks.get(name, 0), n)
            self.stop.wait(0.1)


def _open_held(host: str, port: int, n: int) -> tuple[list[socket.socket], int]:
    socks, failed = [], 0
    for _ in range(n):
        try:
            s = socket.create_connection((host, port), timeout=10)
            s.sendall(PARTIAL_HEAD)
            s.setblocking(False)
            socks.append(s)
        except OSError:
            failed += 1
    return socks, failed


def _watch_held(socks: list[socket.socket], until_s: float) -> list[HeldEnd]:
    """Read every held connection until the server closes it (or ``until_s`` passes); close ours then."""
    ends = [HeldEnd() for _ in socks]
    sel = selectors.DefaultSelector()
    for i, s in enumerate(socks):
        sel.register(s, selectors.EVENT_READ, i)
    deadline = time.monotonic() + until_s
    open_count = len(socks)
    while open_count and (left := deadline - time.monotonic()) > 0:
        for key, _ in sel.select(min(left, 1.0)):
            i, s = key.data, socks[key.data]
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                data = b""
            if data and not ends[i].head:
                ends[i].head = data.split(b"\r\n", 1)[0].decode(errors="replace")
            if not data:
                ends[i].closed_at = time.monotonic()
                sel.unregister(s)
                s.close()
                open_count -= 1
    sel.close()
    for s in socks:
        s.close()
    return ends


async def _clients(url: str, model: str, n: int, spread_s: float, timeout_s: float) -> list[tuple[int, float]]:
    """``n`` completions, one connection each, started evenly over ``spread_s``: (status, seconds) each; status 0
    for a connection error or no answer within ``timeout_s``."""
    import aiohttp

    body = {"model": model, "prompt": "hello there", "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    async def one(k: int) -> tuple[int, float]:
        await asyncio.sleep(spread_s * k / n)
        t0 = time.monotonic()
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
                async with session.post(url + "/v1/completions", json=body) as resp:
                    await resp.read()
                    return resp.status, time.monotonic() - t0
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return 0, time.monotonic() - t0

    return list(await asyncio.gather(*(one(k) for k in range(n))))


def _health(url: str, token: str | None) -> Any:
    from kvrelay.benchmarks.deployment import get_text

    return json.loads(get_text(url + "/health", token=token))


def run(a: argparse.Namespace) -> dict[str, Any]:
    from kvrelay.benchmarks.deployment import Deployment

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = a.held + a.clients + 512
    if soft < need:  # this process holds every connection; the servers keep --server-fds
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, need), hard))
    overrides = {"model": {"name": "tiny", "dtype": "float32"},
                 "kvstore": {"device": {"bytes": "64MiB"}, "host": {"bytes": "128MiB", "fraction_of_free": None},
                             "disk": {"bytes": "256MiB"}},
                 "prefill": {"ports": [0]}, "router": {"disaggregation": "always"}}
    with Deployment(a.model, overrides=overrides, nofile=(a.server_fds, a.server_fds)) as d:
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        health = _health(d.url, d.token)
        pids = {"router": int(health["pid"])}
        for name, node in health["nodes"].items():
            pids[name] = int(_health(node["url"], d.token)["pid"])
        peaks = FdPeaks(pids)
        sampler = threading.Thread(target=peaks.sample, daemon=True)
        sampler.start()
        t0 = time.monotonic()
        held: list[socket.socket] = []
        watch: list[HeldEnd] = []
        marks: dict[str, float] = {}

        def hold() -> None:  # opens every held connection, then reads each until the server closes it
            socks, marks["failed"] = _open_held(host, int(port), a.held)
            held.extend(socks)
            marks["opened"] = time.monotonic()
            watch.extend(_watch_held(socks, a.watch_s))

        holder = threading.Thread(target=hold, daemon=True)
        holder.start()  # the normal clients start with the flood, not after it
        answers = asyncio.run(_clients(d.url, "tiny", a.clients, a.spread_s, a.client_timeout_s))
        holder.join()
        opened, failed = marks["opened"], int(marks["failed"])
        peaks.stop.set()
        sampler.join()
        after = _health(d.url, d.token)
    codes = Counter(str(code) for code, _ in answers)
    refused_s = [s for code, s in answers if code in (429, 503)]
    heads = Counter(e.head or "(nothing)" for e in watch)
    closed = [e.closed_at for e in watch if e.closed_at is not None]
    return {
        "server_fd_limit": a.server_fds, "held_opened": len(held), "held_connect_failures": failed,
        "held_open_s": round(opened - t0, 2), "held_answers": dict(heads),
        "held_closed": len(closed), "held_all_closed_after_s": round(max(closed) - opened, 2) if closed else None,
        "clients": a.clients, "client_status": dict(codes),
        "refused_max_latency_s": round(max(refused_s), 3) if refused_s else None,
        "ok_max_latency_s": round(max((s for c, s in answers if c == 200), default=0.0), 3),
        "peak_open_fds": peaks.peaks,
        "times_down": {name: n["times_down"] for name, n in after["nodes"].items()},
        "nodes_healthy": {name: n["healthy"] for name, n in after["nodes"].items()},
    }


def main(argv: list[str] | None = None) -> int:
    from kvrelay.benchmarks.common import emit

    p = argparse.ArgumentParser(prog="kvrelay bench edges", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=".models/tiny", help="model directory (`kvrelay tiny-model .models/tiny`)")
    p.add_argument("--held", type=int, default=4000, help="connections that never finish their request head")
    p.add_argument("--clients", type=int, default=1000, help="normal completions, one connection each")
    p.add_argument("--spread-s", type=float, default=20.0, help="the normal clients start evenly over this")
    p.add_argument("--server-fds", type=int, default=4096, help="the servers' open-file limit, soft and hard")
    p.add_argument("--watch-s", type=float, default=90.0, help="how long to wait for the server to close them")
    p.add_argument("--client-timeout-s", type=float, default=60.0, help="a normal client gives up after this")
    p.add_argument("--out", default=None, help="also write the JSON here")
    a = p.parse_args(argv)
    if not (Path(a.model) / "config.json").is_file():
        p.error(f"--model {a.model} is not a model directory; `kvrelay tiny-model {a.model}` writes one")
    emit(run(a), a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
