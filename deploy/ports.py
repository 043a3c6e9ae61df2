"""Picking TCP ports that another process will bind a moment later (`kvrelay serve`'s engine node,
the test and benchmark deployments)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports free on loopback right now, below the kernel's ephemeral range.

    A port is chosen here and bound later by another process; a port from the ephemeral range could
    meanwhile be handed to any socket bound to port 0 or to an outgoing connection (NIXL's UCX listeners
    and the nodes' connections take them all the time), so they are drawn from below it.
    """
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    ports: list[int] = []
    socks = []
    try:
        while len(ports) < n:
            port = rng.randrange(max(1024, low // 2), low)
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports
