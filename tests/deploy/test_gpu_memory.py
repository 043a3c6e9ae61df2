"""Issue 64: ``device: auto`` and vLLM's ``gpu_memory_utilization`` (a share of the GPU's *total* memory for the
whole node). No GPU here: the GPU's readings are injected (`deploy.gpu_memory.GpuUse`)."""

from __future__ import annotations

import argparse

import pytest
import torch
from kvrelay.deploy.cli import build_parser, serve_config
from kvrelay.deploy.config import load_config
from kvrelay.deploy.gpu_memory import (
    NON_TORCH_BYTES,
    GpuUse,
    activation_reserve_bytes,
    ignored_on_cpu,
    kv_bytes_for_utilization,
)
from kvrelay.deploy.sizes import ConfigError
from kvrelay.deploy.up import check_gpu_shares
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.model.device import resolve_device

from tests.deploy.test_config import no_nvml, write

GIB = 1 << 30




def test_auto_is_cuda_where_a_gpu_is_visible_else_cpu_and_other_names_are_kept_or_refused():
    assert resolve_device("auto", cuda_available=lambda: True) == "cuda"
    assert resolve_device("auto", cuda_available=lambda: False) == "cpu"
    assert resolve_device("auto") == ("cuda" if torch.cuda.is_available() else "cpu")
    assert [resolve_device(d, cuda_available=lambda: False) for d in ("cpu", "cuda", "cuda:3")] == \
        ["cpu", "cuda", "cuda:3"]
    for bad in ("gpu", "mps", "cuda:x", "CPU", ""):
        with pytest.raises(ValueError, match="is not a device; use auto, cpu, cuda or cuda:N"):
            resolve_device(bad)


def test_the_device_defaults_to_auto_in_yaml_and_a_bad_one_is_named(tmp_path):
    assert load_config(write(tmp_path, "model: {path: m}\n")).model.device == "auto"
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "model: {path: m, device: gpu}\n"))
    assert str(err.value) == "model.device: 'gpu' is not a device; use auto, cpu, cuda or cuda:N"
    assert build_parser().parse_args(["generate", "--model", "m", "--prompt", "x"]).device == "auto"


def test_kv_gets_what_the_share_of_total_memory_leaves_after_weights_and_activations():
    use = GpuUse(total_bytes=80 * GIB, free_bytes=62 * GIB, weights_bytes=16 * GIB, activation_bytes=3 * GIB)
    assert kv_bytes_for_utilization(0.9, use) == 53 * GIB  # 72 GiB - 16 - 3
    assert kv_bytes_for_utilization(0.5, use) == 21 * GIB  # 40 GiB - 16 - 3: a share, not of what is free
    # the same GPU with 40 GiB held by another process: 0.9 of it is not there to take
    busy = GpuUse(total_bytes=80 * GIB, free_bytes=24 * GIB, weights_bytes=16 * GIB, activation_bytes=3 * GIB)
    with pytest.raises(ConfigError) as err:
        kv_bytes_for_utilization(0.9, busy)
    assert str(err.value) == (
        "kvstore.device.gpu_memory_utilization: 0.9 of the GPU's 80.0 GiB is 72.0 GiB, but only 40.0 GiB is free to "
        "this node (its weights counted); other processes hold the rest: lower it, or free the GPU")
    assert kv_bytes_for_utilization(0.5, busy) == 21 * GIB
    with pytest.raises(ConfigError) as err:
        kv_bytes_for_utilization(0.2, use)
    assert str(err.value) == (
        "kvstore.device.gpu_memory_utilization: 0.2 of the GPU's 80.0 GiB is 16.0 GiB, which the weights (16.0 GiB) "
        "and the activation reserve (3.0 GiB) fill, leaving nothing for KV: raise it, or lower "
        "engine.max_num_batched_tokens")


def test_the_activation_reserve_of_llama_3_1_8b_shapes():
    reserve = activation_reserve_bytes(hidden=4096, mlp_width=14336, qkv_width=(32 + 2 * 8) * 128, vocab=128256,
                                       dtype_bytes=2, max_num_batched_tokens=8192, max_num_seqs=64)
    per_token = (2 * 4096 + 6144 + 3 * 14336) * 2  # 114,688 bytes
    assert per_token == 114688
    assert reserve == 8192 * 114688 + 64 * 128256 * 4 * 2 + NON_TORCH_BYTES == 2078932992  # 1.94 GiB


def test_the_device_tier_under_gpu_memory_utilization_in_blocks_and_ignored_on_cpu(tmp_path):
    kv = load_config(write(tmp_path, "model: {path: m, device: cuda}\nkvstore: {device: {gpu_memory_utilization: "
                                     "0.9}}\n"), gpu_free_bytes=no_nvml).kvstore  # NVML is not read for it
    spec = BlockSpec(num_layers=32, num_kv_heads=8, head_dim=128, block_size_tokens=16, dtype="bfloat16")
    assert spec.block_bytes == 2 * GIB // 1024  # 2 MiB: 16 tokens of Llama-3.1-8B's KV
    use = GpuUse(total_bytes=80 * GIB, free_bytes=62 * GIB, weights_bytes=16 * GIB, activation_bytes=3 * GIB)
    store = kv.store_config(spec, device="cuda", gpu_free_bytes=no_nvml, gpu_use=use)
    assert store.num_device_blocks == 53 * 512  # 53 GiB of 2 MiB blocks
    assert kv.device.fraction("cuda") is None and kv.device.fraction("cpu") == 0.2
    with pytest.raises(ConfigError, match="^kvstore.device.gpu_memory_utilization: sizing on cuda needs the GPU's"):
        kv.store_config(spec, device="cuda", gpu_free_bytes=no_nvml)
    # on a CPU device the share means nothing: the tier takes the CPU default of the host memory free at start
    store = kv.store_config(spec, device="cpu", host_free_bytes=lambda: 100 * spec.block_bytes, gpu_free_bytes=no_nvml)
    assert store.num_device_blocks == 20
    assert ignored_on_cpu(0.9, "cpu", kv.device.fraction("cpu")) == (
        "kvstore.device.gpu_memory_utilization 0.9 is ignored on cpu (it is a share of a GPU's memory, as vLLM's "
        "is); the device tier takes 0.2 of the host memory free at start; size it with kvstore.device.bytes "
        "(--kv-cache-memory) instead")
    assert ignored_on_cpu(0.9, "cuda:0", None) is None and ignored_on_cpu(None, "cpu", 0.2) is None
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB, gpu_memory_utilization: "
                                    "0.9}}\n"))
    assert str(err.value) == ("kvstore.device: set one of bytes (e.g. 8GiB), fraction_of_free (e.g. 0.2) and "
                              "gpu_memory_utilization (e.g. 0.9), not two")


def test_serve_maps_the_vllm_flag_to_gpu_memory_utilization_not_a_share_of_free_memory():
    args = build_parser().parse_args(["serve", "m", "--gpu-memory-utilization", "0.8"])
    assert serve_config(args, free_port=1)["kvstore"]["device"] == {"gpu_memory_utilization": 0.8}
    args = build_parser().parse_args(["serve", "Qwen/Qwen3-0.6B", "--revision", "abc", "--download-dir", "/d"])
    assert {k: serve_config(args, free_port=1)["model"][k] for k in ("path", "revision", "download_dir")} == \
        {"path": "Qwen/Qwen3-0.6B", "revision": "abc", "download_dir": "/d"}
    assert isinstance(args, argparse.Namespace) and args.device is None  # the YAML's model.device (auto) stands


def test_up_refuses_shares_that_the_nodes_on_one_gpu_cannot_all_take(tmp_path):
    def config(device: str, util: float, devices: str = "") -> object:
        return load_config(write(tmp_path, f"""
            model: {{path: m, device: {device}}}
            kvstore: {{device: {{gpu_memory_utilization: {util}}}}}
            prefill: {{ports: [8100]{devices and f', devices: ["{devices[0]}"]'}}}
            decode: {{ports: [8200]{devices and f', devices: ["{devices[1]}"]'}}}
        """))

    with pytest.raises(ConfigError) as err:
        check_gpu_shares(config("cuda", 0.9), gpu_count=lambda: 1)
    assert str(err.value) == (
        "kvstore.device.gpu_memory_utilization: 0.9 is each node's share of its GPU's memory, and 2 nodes "
        "(prefill-0, decode-0) share cuda: 1.8 of it; use at most 0.50, or give each node its own GPU "
        "(prefill.devices, decode.devices)")
    check_gpu_shares(config("cuda", 0.5), gpu_count=lambda: 1)
    check_gpu_shares(config("cuda", 0.9, "01"), gpu_count=lambda: 2)  # one GPU each
    with pytest.raises(ConfigError, match="share auto: 1.8 of it"):
        check_gpu_shares(config("auto", 0.9), gpu_count=lambda: 1)
    check_gpu_shares(config("auto", 0.9), gpu_count=lambda: 0)  # auto on a machine without a GPU: the CPU, ignored
    check_gpu_shares(config("cpu", 0.9), gpu_count=lambda: 1)
