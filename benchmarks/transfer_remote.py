"""``kvrelay bench transfer --remote``: NIXL READ between two hosts over UCX's TCP transport, against a
raw TCP stream between the same two hosts, in one run.

The hosts are network namespaces on a bridge (`benchmarks.netns`; needs root): the owner runs on one,
this process (the reader) joins the network as the other. UCX is held to TCP (``UCX_TLS=tcp``) on the
hosts' veth interfaces, so no shared memory or loopback shortcut hides the cost of the transfer stack.
The raw stream is what a plain socket moves between the same hosts (one connection, ``sendall`` of
4 MiB chunks into ``recv_into``): the ratio READ / raw is the price of NIXL, UCX and descriptors.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvrelay.benchmarks.common import machine_label

MIB = 1024 * 1024
RAW_PORT = 5201  # iperf3's
RAW_CHUNK = 4 * MIB
CONFIGS = [(MIB, 16), (MIB, 64), (256 * 1024, 64)]  # (block bytes, blocks per READ)

# Runs on the owner host: `transfer_read.owner_loop` on the socket it was handed, and a raw TCP sender.
OWNER = """
import socket, sys, threading
from multiprocessing.connection import Connection
from kvrelay.benchmarks.transfer_read import owner_loop

def raw(addr, port, chunk):
    srv = socket.create_server((addr, port))
    payload = bytes(chunk)
    while True:
        conn, _ = srv.accept()
        with conn:
            total = int.from_bytes(conn.recv(8), "little")
            sent = 0
            while sent < total:
                conn.sendall(payload[: min(chunk, total - sent)])
                sent += min(chunk, total - sent)

threading.Thread(target=raw, args=(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])), daemon=True).start()
owner_loop(Connection(int(sys.argv[1])))
"""


def _raw_stream_gbps(addr: str, total: int, repeats: int) -> list[float]:
    """GB/s of ``repeats`` raw TCP transfers of ``total`` bytes from the owner host."""
    buf = bytearray(RAW_CHUNK)
    view = memoryview(buf)
    rates = []
    for _ in range(repeats):
        with socket.create_connection((addr, RAW_PORT), timeout=60) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 * MIB)
            t0 = time.perf_counter()
            s.sendall(total.to_bytes(8, "little"))
            got = 0
            while got < total:
                n = s.recv_into(view)
                if n == 0:
                    raise RuntimeError(f"the raw stream ended after {got} of {total} bytes")
                got += n
            rates.append(total / (time.perf_counter() - t0) / 1e9)
    return rates


def run_remote(*, pool_mib: int, target_mib: int, seed: int) -> dict[str, Any]:
    from kvrelay.benchmarks.netns import Hosts, netns_problem
    from kvrelay.benchmarks.transfer_read import read_sweep

    problem = netns_problem()
    if problem is not None:
        raise SystemExit(f"kvrelay bench transfer --remote: {problem}")
    work = Path(tempfile.mkdtemp(prefix="kvrelay-remote-"))
    repo = str(Path(__file__).resolve().parents[1])
    with Hosts(["owner"], work) as hosts:
        owner_addr = hosts.addr("owner")
        ours, theirs = socket.socketpair()
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0", "PYTHONPATH": repo}
        hosts.popen("owner", [sys.executable, "-c", OWNER, str(theirs.fileno()), owner_addr, str(RAW_PORT),
                              str(RAW_CHUNK)], env=env, log_name="owner.log", pass_fds=[theirs.fileno()])
        theirs.close()
        os.environ["UCX_TLS"] = "tcp"  # this process is the reader host: TCP on its veth only
        os.environ["UCX_NET_DEVICES"] = hosts.client_if
        conn = Connection(ours.detach())
        deadline = time.monotonic() + 60
        while True:  # the raw sender is up once it accepts
            try:
                socket.create_connection((owner_addr, RAW_PORT), timeout=2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the owner host never came up: " + (work / "owner.log").read_text()) from None
                time.sleep(0.2)
        sizes = {"pool_bytes": pool_mib * MIB, "target_bytes": target_mib * MIB, "seed": seed}
        raw_before = _raw_stream_gbps(owner_addr, target_mib * MIB, 3)
        rows = asyncio.run(read_sweep(conn, CONFIGS, hugepages=False, **sizes))
        raw_after = _raw_stream_gbps(owner_addr, target_mib * MIB, 3)
        conn.send(("exit",))
    raw = sorted(raw_before + raw_after)[len(raw_before + raw_after) // 2]
    for row in rows:
        row["raw_tcp_gbps"] = round(raw, 3)
        row["ratio_vs_raw_tcp"] = round(row["read_gbps"] / raw, 3)
    return {
        "bench": "transfer-remote", **machine_label(),
        "setup": {"hosts": "two network namespaces on a bridge (veth)", "ucx": "UCX_TLS=tcp on the veths",
                  "raw_tcp": f"one connection, sendall of {RAW_CHUNK // MIB} MiB chunks into recv_into; median "
                             "of 3 runs before and 3 after the READs",
                  "pool_mib_per_block_size": pool_mib, "bytes_per_config_mib": target_mib},
        "raw_tcp_gbps": [round(r, 3) for r in raw_before + raw_after],
        "read": rows,
    }
