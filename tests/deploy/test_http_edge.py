"""`deploy.http_edge`: the open-file limit raised at start, the connection cap sized against it, and
``router.max_concurrent_requests`` clamped to the descriptors left (the servers themselves: tests/services/
test_connection_edge.py)."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys

import pytest
from kvrelay.deploy.http_edge import FD_RESERVE, admitted_requests_cap, edge_limits


def test_the_soft_limit_is_raised_to_the_hard_one():
    code = ("import resource; from kvrelay.deploy.http_edge import raise_fd_limit; "
            "print(raise_fd_limit(), resource.getrlimit(resource.RLIMIT_NOFILE))")
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = min(hard, 4096) if hard != resource.RLIM_INFINITY else 4096
    done = subprocess.run(["prlimit", f"--nofile=1024:{wanted}", sys.executable, "-c", code], capture_output=True,
                          text=True, timeout=60, check=True)
    assert done.stdout.split(None, 1) == [str(wanted), f"({wanted}, {wanted})\n"]


def test_the_cap_defaults_to_half_the_limit_and_one_that_leaves_no_reserve_is_refused():
    assert edge_limits(header_read_timeout_s=10.0, max_open_connections=None, fd_limit=1024,
                       key_prefix="router").max_open_connections == 512
    assert edge_limits(header_read_timeout_s=10.0, max_open_connections=1024 - FD_RESERVE, fd_limit=1024,
                       key_prefix="internal").max_open_connections == 896
    with pytest.raises(ValueError) as err:
        edge_limits(header_read_timeout_s=10.0, max_open_connections=1000, fd_limit=1024, key_prefix="router")
    assert str(err.value).startswith("router.max_open_connections: 1000 connections do not fit the open-file limit "
                                     "of 1024 (ulimit -n) less 128 kept for the server's own files and connections; "
                                     "lower it to at most 896")


def test_max_concurrent_requests_is_clamped_to_the_descriptors_left_with_a_warning(caplog):
    limits = edge_limits(header_read_timeout_s=10.0, max_open_connections=None, fd_limit=1024, key_prefix="router")
    with caplog.at_level(logging.WARNING, logger="kvrelay.deploy.http_edge"):
        assert admitted_requests_cap(16384, limits=limits, fd_limit=1024) == 192  # (1024 - 512 - 128) // 2
    assert "router.max_concurrent_requests 16384 is lowered to 192" in caplog.text
    caplog.clear()
    assert admitted_requests_cap(100, limits=limits, fd_limit=1024) == 100
    assert caplog.text == ""


def test_a_router_whose_cap_does_not_fit_the_limit_refuses_to_start_naming_the_key(tmp_path):
    cfg = tmp_path / "kvrelay.yaml"
    cfg.write_text("model: {path: m}\nkvstore: {device: {bytes: 8MiB}}\nrouter: {max_open_connections: 5000}\n")
    done = subprocess.run(["prlimit", "--nofile=1024:1024", sys.executable, "-m", "kvrelay.deploy.cli", "router",
                           "--config", str(cfg)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.startswith("kvrelay router: refusing to start: router.max_open_connections: 5000 connections "
                                  "do not fit the open-file limit of 1024 (ulimit -n)"), done.stderr
