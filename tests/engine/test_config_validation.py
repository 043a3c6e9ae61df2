"""Component configs validate themselves at construction, naming the field (YAML goes through
`deploy.config` first, which names the YAML key; these guard programmatic construction)."""

from __future__ import annotations

import pytest
from kvrelay.engine.engine import EngineConfig
from kvrelay.kvstore.tiered_store import TieredStoreConfig
from kvrelay.router.app import RouterConfig


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_blocks": 0}, "num_blocks must be a positive integer, got 0"),
    ({"block_size_tokens": -16}, "block_size_tokens must be a positive integer, got -16"),
    ({"max_num_seqs": 1.5}, "max_num_seqs must be a positive integer, got 1.5"),
    ({"max_num_batched_tokens": True}, "max_num_batched_tokens must be a positive integer, got True"),
    ({"max_model_len": 0}, "max_model_len must be a positive integer, got 0"),
    ({"attention_backend": "flash"}, "attention_backend must be one of \\['reference', 'torch', 'triton'\\]"),
])
def test_engine_config_names_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"decode_urls": ("127.0.0.1:8200",)}, "node URLs must start with http:// or https://, got '127.0.0.1:8200'"),
    ({"prefill_urls": ("http://a:1",)}, "prefill nodes need at least one decode node"),
    ({"port": 70000}, "port must be an integer in \\[0, 65535\\], got 70000"),
    ({"max_n": 0}, "max_n must be a positive integer, got 0"),
    ({"max_body_bytes": -1}, "max_body_bytes must be a positive integer, got -1"),
    ({"load_weight_tokens": -1}, "load_weight_tokens must be an integer >= 0, got -1"),
    ({"request_timeout_s": 0}, "request_timeout_s must be > 0 seconds, got 0"),
    ({"request_timeout_s": float("nan")}, "request_timeout_s must be > 0 seconds, got nan"),
    ({"event_wait_s": 31}, "event_wait_s must be in \\[0, 30\\] seconds, got 31"),
    ({"event_poll_interval_s": -0.1}, "event_poll_interval_s must be >= 0 seconds, got -0.1"),
])
def test_router_config_names_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(model_name="m", model_dir="/m", **kwargs)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"num_device_blocks": 0}, "num_device_blocks must be a positive integer, got 0"),
    ({"num_host_blocks": -1}, "num_host_blocks must be an integer >= 0, got -1"),
    ({"disk_path": "/tmp/x"}, "a disk tier at '/tmp/x' needs disk_capacity_bytes > 0"),
    ({"watermark_blocks": 11}, "watermark_blocks must be in \\[0, num_device_blocks=10\\], got 11"),
    ({"admit": "sometimes"}, "'sometimes' is not an admission policy"),
])
def test_store_config_names_the_bad_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TieredStoreConfig(**{"num_device_blocks": 10, **kwargs})


def test_good_configs_construct() -> None:
    assert EngineConfig(num_blocks=8, max_model_len=64, attention_backend="torch").num_blocks == 8
    assert RouterConfig(model_name="m", model_dir="/m", prefill_urls=("http://a:1",),
                        decode_urls=("https://b:2",), port=0).port == 0
    assert TieredStoreConfig(num_device_blocks=10, disk_path="/tmp/x", disk_capacity_bytes=1,
                             watermark_blocks=10, admit="seen>=2").watermark_blocks == 10
