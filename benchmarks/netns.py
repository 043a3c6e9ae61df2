"""A private network of "hosts" for tests and benchmarks: one Linux network namespace per host, each with one veth
(``eth0``) on a bridge that lives in a namespace of its own, addresses in a private subnet. The test
process joins the network too (a veth in its own namespace, ``client_addr``), so it talks to the hosts
directly. Everything is removed on exit, processes first.

Needs root (CI runs as root); `netns_problem` says why it cannot run elsewhere.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

SUBNET = "10.251.77"  # private (10/8); the test adds and removes the only route into it


def _ip(*args: str, ns: str | None = None) -> None:
    argv = ["ip", *(["netns", "exec", ns, "ip"] if ns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")


def netns_problem() -> str | None:
    """None if this process may create network namespaces and veth pairs, else why not."""
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    name = f"kvprobe{os.getpid() % 100000}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError) as exc:
        return f"`ip netns add` is not permitted here: {exc}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)
    return None


class Hosts:
    """``names`` as hosts on one bridge; ``addr(name)`` is each one's address.

    Use as a context manager. `popen` starts a process inside a host; `link(name, up=False)` cuts a host
    off the network (its processes keep running), `link(name, up=True)` brings it back.
    """

    def __init__(self, names: Sequence[str], log_dir: Path) -> None:
        tag = f"kv{os.getpid() % 10000}"
        self._tag = tag
        self._switch = f"{tag}-sw"
        self._ns = {name: f"{tag}-{name}" for name in names}
        self._addr = {name: f"{SUBNET}.{10 + i}" for i, name in enumerate(names)}
        self._switch_if = {name: f"{tag}s{i}" for i, name in enumerate(names)}  # each host's port on the bridge
        self.client_addr = f"{SUBNET}.2"
        self.client_if = f"{tag}c"  # this process's interface on the network
        self._log_dir = log_dir
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: list[IO[Any]] = []

    def addr(self, name: str) -> str:
        return self._addr[name]

    def __enter__(self) -> Hosts:
        try:
            self._create()
        except BaseException:
            self._destroy()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._destroy()

    def _create(self) -> None:
        _ip("netns", "add", self._switch)
        _ip("link", "add", "br0", "type", "bridge", ns=self._switch)
        _ip("link", "set", "br0", "up", ns=self._switch)
        for i, (name, ns) in enumerate(self._ns.items()):
            _ip("netns", "add", ns)
            _ip("link", "set", "lo", "up", ns=ns)
            self._plug(f"{self._tag}h{i}", self._switch_if[name], ns, self._addr[name])
        # The test process's own end: a veth in this namespace (the one route into the subnet).
        _ip("link", "add", self.client_if, "type", "veth", "peer", "name", f"{self._tag}sc")
        _ip("link", "set", f"{self._tag}sc", "netns", self._switch)
        _ip("link", "set", f"{self._tag}sc", "master", "br0", "up", ns=self._switch)
        _ip("addr", "add", f"{self.client_addr}/24", "dev", self.client_if)
        _ip("link", "set", self.client_if, "up")

    def _plug(self, host_if: str, switch_if: str, ns: str, addr: str) -> None:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", switch_if)
        _ip("link", "set", switch_if, "netns", self._switch)
        _ip("link", "set", switch_if, "master", "br0", "up", ns=self._switch)
        _ip("link", "set", host_if, "netns", ns)
        _ip("link", "set", host_if, "name", "eth0", ns=ns)
        _ip("addr", "add", f"{addr}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)

    def popen(self, name: str, argv: Sequence[str], *, env: dict[str, str], log_name: str,
              pass_fds: Sequence[int] = ()) -> subprocess.Popen:
        """Start ``argv`` inside host ``name``; its output goes to ``log_dir/log_name``."""
        log = open(self._log_dir / log_name, "w")  # noqa: SIM115 - closed in _destroy
        self._logs.append(log)
        proc = subprocess.Popen(["ip", "netns", "exec", self._ns[name], *argv], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True, pass_fds=tuple(pass_fds))
        self._procs.append((name, proc))
        return proc

    def link(self, name: str, *, up: bool) -> None:
        """Cut host ``name`` off the network (``up=False``) or plug it back in."""
        _ip("link", "set", "eth0", "up" if up else "down", ns=self._ns[name])

    def shape(self, name: str, *, rate: str | None) -> None:
        """Limit the traffic the network delivers to host ``name`` to ``rate`` (tc syntax, e.g. "1mbit",
        on its switch port); None lifts the limit."""
        port = self._switch_if[name]
        if rate is None:
            subprocess.run(["ip", "netns", "exec", self._switch, "tc", "qdisc", "del", "dev", port, "root"],
                           capture_output=True, timeout=30)
            return
        argv = ["ip", "netns", "exec", self._switch, "tc", "qdisc", "replace", "dev", port, "root", "tbf",
                "rate", rate, "burst", "16kb", "latency", "400ms"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")

    def _destroy(self) -> None:
        for _, proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for _, proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        for log in self._logs:
            log.close()
        subprocess.run(["ip", "link", "del", self.client_if], capture_output=True, timeout=30)
        for ns in (*self._ns.values(), self._switch):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
