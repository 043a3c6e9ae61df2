"""An idle deployment sleeps: `kvrelay up` (router + prefill + decode) uses almost no CPU between requests."""

from __future__ import annotations

import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import openai
import pytest
from kvrelay.deploy.cpu_budget import available_cpus, split_cpus
from kvrelay.model.cpu_identity import this_cpu
from kvrelay.transfer.config import TOKEN_HEADER

from tests.services.cluster import Cluster, get_json

IDLE_WINDOW_S = 5.0
MAX_IDLE_CPU_S = 0.25  # 5% of one CPU, all four processes together: 25 clock ticks of 10 ms
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _wait_until_settled(urls: list[str], timeout_s: float = 30.0) -> None:
    """Every node reports nothing running and no block in use (the finished request's KV handed back)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = [get_json(url + "/health") for url in urls]
        if all(h["running"] == 0 and h["waiting"] == 0 and h["in_use_blocks"] == 0 for h in health):
            return
        assert time.monotonic() < deadline, f"nodes did not settle: {health}"
        time.sleep(0.1)


def _cpu_s(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` so far (all their threads)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / CLOCK_TICKS


def test_idle_deployment_uses_under_a_twentieth_of_a_cpu(tiny_model_dir: Path) -> None:
    with Cluster(tiny_model_dir) as cluster:
        pids = _tree(cluster._proc.pid)
        assert len(pids) == 4, pids  # kvrelay up, router, prefill, decode
        health = [get_json(url + "/health") for url in cluster.prefill_urls + cluster.decode_urls]
        assert [h["cpus"] for h in health] == split_cpus(available_cpus(), 2)  # the thread budget: own CPUs
        assert [h["cpu_pool"] for h in health] == [available_cpus()] * 2  # ... and the idle ones it may borrow
        assert [h["threads"] for h in health] == [len(h["cpus"]) for h in health]
        # each node's kernel paths, timed on this CPU: the same for both where one read the other's (or both read
        # one); both measure only where the first was preempted while measuring and kept nothing
        plans = [{k: v for k, v in h["kernel_plan"].items() if k != "source"} for h in health]
        sources = sorted(h["kernel_plan"]["source"] for h in health)
        assert [p["cpu"] for p in plans] == [this_cpu().kernel_label] * 2
        assert sources in (["cached", "cached"], ["cached", "measured"], ["measured", "measured"])
        if sources != ["measured", "measured"]:
            assert plans[0] == plans[1]
        openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0).completions.create(
            model="tiny", prompt=list(range(1, 40)), max_tokens=4)  # every part has run once: KV moved over NIXL
        _wait_until_settled(cluster.prefill_urls + cluster.decode_urls)  # leases released, nothing running
        before, start = _cpu_s(pids), time.monotonic()
        time.sleep(IDLE_WINDOW_S)
        used = _cpu_s(pids) - before
        elapsed = time.monotonic() - start
    assert used < MAX_IDLE_CPU_S * elapsed / IDLE_WINDOW_S, f"{used:.2f} CPU-s in {elapsed:.1f} s"


def test_event_long_poll_answers_when_a_block_is_stored(tiny_model_dir: Path) -> None:
    """The router's long poll: a node holds ``/kv/events`` until it has news, up to ``wait_s``."""
    with Cluster(tiny_model_dir, overrides={"prefill": {"ports": []}}) as cluster:  # one node: decode
        node = cluster.decode_urls[0]

        def open_(url: str, timeout: float) -> Any:  # internal endpoints want the cluster's token
            return urllib.request.urlopen(urllib.request.Request(url, headers={TOKEN_HEADER: cluster.token}),
                                          timeout=timeout)
        last = msgpack.unpackb(open_(node + "/kv/events?after=0", timeout=10).read())["last_seq"]
        start = time.monotonic()
        quiet = msgpack.unpackb(open_(f"{node}/kv/events?after={last}&wait_s=1", timeout=10).read())
        assert quiet["events"] == [] and quiet["last_seq"] == last and time.monotonic() - start >= 1.0
        with ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(lambda: open_(f"{node}/kv/events?after={last}&wait_s=30",
                                                                 timeout=60).read())
            openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0).completions.create(
                model="tiny", prompt=list(range(1, 40)), max_tokens=2)  # 39 tokens: two full blocks stored
            batch = msgpack.unpackb(waiting.result(timeout=30))
        # The poll answers at the first event; the writer may add the second right after (another thread).
        assert batch["events"][0][1] == "stored" and time.monotonic() - start < 25
        kinds = [e[1] for e in batch["events"]]
        while len(kinds) < 2:
            batch = msgpack.unpackb(open_(f"{node}/kv/events?after={batch['last_seq']}&wait_s=5", timeout=10).read())
            assert batch["events"], "the second block's event never came"
            kinds += [e[1] for e in batch["events"]]
        assert kinds[:2] == ["stored", "stored"]
        with pytest.raises(urllib.error.HTTPError) as err:
            open_(f"{node}/kv/events?after=0&wait_s=31", timeout=10)
        assert err.value.code == 400 and b"wait_s must be in [0, 30]" in err.value.read()
