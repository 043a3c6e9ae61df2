"""`kvrelay bench serve`'s kvstore flags become the kvrelay baselines' ``kvstore`` overrides."""

from __future__ import annotations

import argparse

from kvrelay.benchmarks.deployment import merge
from kvrelay.benchmarks.serve_baselines import kvstore_overrides
from kvrelay.benchmarks.serve_bench import build_parser


def test_device_only_with_one_policy():
    args = build_parser().parse_args(["--baselines", "aggregated", "--kv-policy", "lru", "--kv-device-bytes",
                                      "8MiB", "--kv-host-bytes", "0", "--kv-no-disk"])
    over = kvstore_overrides(args)
    device = {"bytes": "8MiB", "fraction_of_free": None, "policy": "lru"}
    assert over == {"kvstore": {"device": device, "host": None, "disk": None}}
    base = {"kvstore": {"block_size_tokens": 16, "device": {"fraction_of_free": 0.9}, "host": {"bytes": "128MiB"},
                        "disk": {"path": "d", "bytes": "1GiB"}}}
    # bytes replace the base's fraction (None reads as absent), and the lower tiers are gone
    assert merge(base, over)["kvstore"] == {"block_size_tokens": 16, "device": device, "host": None, "disk": None}


def test_policy_alone_applies_to_every_tier_and_nothing_given_changes_nothing():
    args = argparse.Namespace(kv_policy="cold-tail", kv_device_bytes=None, kv_host_bytes=None, kv_no_disk=False)
    assert kvstore_overrides(args) == {"kvstore": {"device": {"policy": "cold-tail"}, "host": {"policy": "cold-tail"},
                                                   "disk": {"policy": "cold-tail"}}}
    assert kvstore_overrides(argparse.Namespace()) == {}


def test_vllm_is_started_with_the_dtype_kvrelay_resolves_unless_its_flags_are_given():
    from kvrelay.benchmarks.serve_baselines import vllm_args
    from kvrelay.model.dtype import resolve_dtype

    parser = build_parser()
    assert vllm_args(parser.parse_args(["--baselines", "vllm"])) == ["--dtype", resolve_dtype("auto", "cpu")]
    assert vllm_args(parser.parse_args(["--baselines", "vllm", "--vllm-args", ""])) == []
    assert vllm_args(parser.parse_args(["--baselines", "vllm", "--vllm-args", "--dtype bfloat16 --max-num-seqs 8"])) \
        == ["--dtype", "bfloat16", "--max-num-seqs", "8"]
