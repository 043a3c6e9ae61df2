import math
import textwrap
from pathlib import Path

import pytest
from kvrelay.deploy.config import DEFAULT_CONFIG, ConfigError, load_config, nvml_free_bytes
from kvrelay.kvstore.block_spec import BlockSpec

GOOD = """
model: {path: models/tiny}
kvstore:
  block_size_tokens: 4
  device: {bytes: 64KiB}
  host: {bytes: "1.5MiB"}
  disk: {path: kv/disk, bytes: 8388608, admit: "seen >= 2"}
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvrelay.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def no_nvml() -> int:
    raise RuntimeError("NVML Shared Library Not Found")


def test_kvstore_section_becomes_sizes_in_bytes_and_paths_from_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    kv = load_config(write(tmp_path, GOOD), gpu_free_bytes=no_nvml).kvstore
    assert kv.block_size_tokens == 4
    assert (kv.device.size_bytes, kv.device.free_memory_frac) == (65536, None)
    assert kv.host.size_bytes == 1572864
    assert (kv.disk.path, kv.disk.size_bytes, kv.disk.admit) == (str(tmp_path / "kv/disk"), 8388608, "seen >= 2")
    spec = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=4)  # 2 KiB blocks
    store = kv.store_config(spec, gpu_free_bytes=no_nvml)
    assert (store.num_device_blocks, store.num_host_blocks, store.disk_capacity_bytes) == (32, 768, 8388608)
    assert (store.disk_path, store.admit) == (kv.disk.path, "seen >= 2")
    with pytest.raises(ConfigError, match="kvstore.block_size_tokens: 4 but the model's KV blocks have 16"):
        kv.store_config(BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16))


def test_tiers_are_optional_and_fraction_of_free_reads_nvml(tmp_path):
    path = write(tmp_path, """
        model: {path: m}
        kvstore: {device: {fraction_of_free: 0.5}}
    """)
    kv = load_config(path, gpu_free_bytes=lambda: 10 << 20).kvstore
    assert kv.host is None and kv.disk is None and kv.block_size_tokens == 16
    assert kv.device.free_memory_frac == 0.5
    assert kv.device_num_blocks(1 << 20, lambda: 10 << 20) == 5
    with pytest.raises(ConfigError, match="kvstore.device.fraction_of_free: 524288 bytes hold no 1048576-byte"):
        kv.device_num_blocks(1 << 20, lambda: 1 << 20)


def test_fraction_of_free_without_nvml_fails_at_start_saying_to_use_bytes(tmp_path):
    path = write(tmp_path, "model: {path: m, device: cuda}\nkvstore: {device: {fraction_of_free: 0.9}}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, gpu_free_bytes=no_nvml)
    assert str(err.value).startswith("kvstore.device.fraction_of_free: cannot read free GPU memory through NVML")
    assert 'set kvstore.device.bytes instead, e.g. "8GiB"' in str(err.value)
    try:
        nvml_free_bytes()
    except Exception:  # this machine has no NVML: the real reader fails the same way
        with pytest.raises(ConfigError, match="kvstore.device.fraction_of_free: cannot read free GPU memory"):
            load_config(path)


def test_cpu_tiers_default_to_shares_of_free_host_memory_and_bytes_win(tmp_path):
    """Issue 28: on CPU an absent device size is DEFAULT_DEVICE_FRACTION["cpu"] of the host memory free at
    start (the node's share under `kvrelay up`), a host fraction is of the same reading, and bytes win."""
    spec = BlockSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size_tokens=16)  # 8 KiB blocks
    readings = []

    def free() -> int:
        readings.append(1)
        return 100 * spec.block_bytes

    kv = load_config(write(tmp_path, "model: {path: m}\nkvstore: {host: {fraction_of_free: 0.1}}\n"),
                     gpu_free_bytes=no_nvml).kvstore
    assert (kv.device.size_bytes, kv.device.free_memory_frac, kv.device.fraction("cpu")) == (None, None, 0.2)
    assert kv.device.fraction("cuda:0") == 0.85
    store = kv.store_config(spec, device="cpu", host_free_bytes=free, gpu_free_bytes=no_nvml)
    assert (store.num_device_blocks, store.num_host_blocks) == (20, 10)
    assert len(readings) == 1  # one reading for both tiers
    kv = load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 64KiB}, host: {bytes: 32KiB}}\n"),
                     gpu_free_bytes=no_nvml).kvstore
    store = kv.store_config(spec, device="cpu", host_free_bytes=no_nvml, gpu_free_bytes=no_nvml)
    assert (store.num_device_blocks, store.num_host_blocks) == (8, 4)  # bytes: nothing is read


def test_free_host_bytes_is_meminfo_within_the_cgroup_limit(tmp_path):
    from kvrelay.deploy.memory import free_host_bytes

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 24000000 kB\nMemFree: 1000 kB\nMemAvailable: 20000000 kB\n")
    cgroup = tmp_path / "cg"
    cgroup.mkdir()
    assert free_host_bytes(meminfo=meminfo, cgroup=cgroup) == 20000000 * 1024  # no cgroup files: MemAvailable
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("123\n")
    assert free_host_bytes(meminfo=meminfo, cgroup=cgroup) == 20000000 * 1024  # no limit
    (cgroup / "memory.max").write_text(f"{8 << 30}\n")
    (cgroup / "memory.current").write_text(f"{3 << 30}\n")
    assert free_host_bytes(meminfo=meminfo, cgroup=cgroup) == 5 << 30  # a pod's limit minus its usage
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(OSError, match="no MemAvailable line"):
        free_host_bytes(meminfo=meminfo, cgroup=cgroup)


@pytest.mark.parametrize(
    ("kvstore", "message"),
    [
        ("{device: {bytes: 1GiB}, disk: {path: d, bytes: 8GB}}",
         'kvstore.disk.bytes: \'8GB\' is not a size; use e.g. "8GiB"'),
        ("{device: {bytes: -4096}}", "kvstore.device.bytes: -4096 must be positive"),
        ("{device: {bytes: true}}", "kvstore.device.bytes: True is not a size"),
        ("{device: {bytes: 1GiB, fraction_of_free: 0.5}}",
         "kvstore.device: set one of bytes (e.g. 8GiB), fraction_of_free (e.g. 0.2) and gpu_memory_utilization "
         "(e.g. 0.9), not two"),
        ("{host: {bytes: 1GiB, fraction_of_free: 0.5}}",
         "kvstore.host: set one of bytes (e.g. 16GiB) and fraction_of_free (e.g. 0.1), not both"),
        ("{host: {fraction_of_free: 0}}", "kvstore.host.fraction_of_free: 0 is not a fraction in"),
        ("{device: 8GiB}", "kvstore.device: must be a mapping"),
        ("{device: {fraction_of_free: 1.5}}", "kvstore.device.fraction_of_free: 1.5 is not a fraction in (0, 1]"),
        ("{device: {bytes: 1GiB, size: 2}}", "kvstore.device.size: unknown key"),
        ("{device: {bytes: 1GiB}, host: {bytes: lots}}", "kvstore.host.bytes: 'lots' is not a size"),
        ("{device: {bytes: 1GiB}, host: {byte: 1GiB}}", "kvstore.host.byte: unknown key"),
        ("{device: {bytes: 1GiB}, disk: {path: d, bytes: 1GiB, admit: twice}}",
         "kvstore.disk.admit: 'twice' is not an admission policy"),
        ("{device: {bytes: 1GiB}, disk: {path: d, bytes: 1GiB, admit: seen>=0}}",
         "kvstore.disk.admit: 'seen>=0' is not an admission policy"),
        ("{device: {bytes: 1GiB}, disk: {bytes: 1GiB}}", "kvstore.disk.path: required with a disk tier"),
        ("{device: {bytes: 1GiB}, disk: {path: d}}", "kvstore.disk.bytes: required with a disk tier"),
        ("{device: {bytes: 1GiB}, disk: {path: d, bytes: 1GiB, sizee: 2}}", "kvstore.disk.sizee: unknown key"),
        ("{device: {bytes: 1GiB}, colour: blue}", "kvstore.colour: unknown key"),
        ("{device: {bytes: 1GiB}, block_size_tokens: 0}", "kvstore.block_size_tokens: 0 is not a positive integer"),
        ("[1, 2]", "kvstore: must be a mapping"),
        ("{device: {bytes: 1GiB}, dtype: auto}",
         "kvstore.dtype: 'auto' is not one of ['bfloat16', 'float16', 'float32']"),
        ("{device: {bytes: 1GiB}, integrity: maybe}",
         "kvstore.integrity: 'maybe' is not one of ['off', 'sampled', 'all']"),
        ("{device: {bytes: 1GiB}, integrity_sample_rate: 0}",
         "kvstore.integrity_sample_rate: 0 is not a fraction in (0, 1]"),
    ],
)
def test_every_bad_value_names_its_key_path(tmp_path, kvstore, message):
    path = write(tmp_path, f"model: {{path: m}}\nkvstore: {kvstore}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path, gpu_free_bytes=no_nvml)
    assert str(err.value).startswith(message), str(err.value)


def test_file_level_errors(tmp_path):
    with pytest.raises(ConfigError, match="kvstor: unknown key"):
        load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\nkvstor: {}\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "kvstore: {device: [\n"))
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(write(tmp_path, "- 1\n"))


def test_shipped_configs_load(monkeypatch):
    monkeypatch.chdir(DEFAULT_CONFIG.parent.parent.parent)
    for path in sorted(DEFAULT_CONFIG.parent.glob("*.yaml")):
        config = load_config(path, gpu_free_bytes=lambda: 80 << 30)
        d = config.kvstore.device  # each is sized one way: bytes, a share of free memory, or vLLM's share of total
        assert d.size_bytes or d.fraction(config.model.device) or d.gpu_memory_utilization, path


def test_decode_long_context_section(tmp_path):
    from kvrelay.engine.long_context import LongContextConfig

    base = "model: {path: m}\nkvstore: {device: {bytes: 1GiB}, host: {bytes: 1GiB}}\n"
    config = load_config(write(tmp_path, base + "decode:\n  long_context: {policy: infinigen, device_budget_tokens: "
                                              "1024, sink_tokens: 32, recent_tokens: 128, recall_blocks: 8}\n"))
    assert config.decode.long_context == LongContextConfig("infinigen", 1024, 32, 128, 8)
    assert load_config(write(tmp_path, base)).decode.long_context == LongContextConfig()
    spec = load_config(write(tmp_path, base + "decode:\n  long_context: {policy: infinigen, selection: speculative, "
                                            "speculation_alpha: 3, partial_channels_frac: 0.3}\n"))
    assert spec.decode.long_context == LongContextConfig("infinigen", selection="speculative", speculation_alpha=3.0,
                                                         partial_channels_frac=0.3)
    for text, message in [
        ("  long_context: {policy: lru}\n", "decode.long_context.policy: 'lru' is not one of"),
        ("  long_context: {selection: top}\n", "decode.long_context.selection: 'top' is not one of"),
        ("  long_context: {speculation_alpha: -2}\n",
         "decode.long_context.speculation_alpha: -2 is not a finite number >= 0"),
        ("  long_context: {partial_channels_frac: 1.5}\n",
         "decode.long_context.partial_channels_frac: 1.5 is not a number in \\(0, 1\\]"),
        ("  long_context: {sink_tokens: -1}\n", "decode.long_context.sink_tokens: -1 is not an integer >= 0"),
        ("  long_context: {budget: 3}\n", "decode.long_context.budget: unknown key"),
        ("  long_context: {policy: h2o, device_budget_tokens: 32}\n",
         "decode.long_context: h2o evicts down to 16 tokens"),
    ]:
        with pytest.raises(ConfigError, match=message):
            load_config(write(tmp_path, base + "decode:\n" + text))
    with pytest.raises(ConfigError, match="infinigen offloads to the host tier; set kvstore.host.bytes"):
        load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
                                    "decode: {long_context: {policy: infinigen}}\n"))


def test_dtypes_default_to_auto_weights_and_kv_following_them(tmp_path):
    config = load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"))
    assert (config.model.dtype, config.kvstore.dtype) == ("auto", None)
    config = load_config(write(tmp_path, "model: {path: m, dtype: float32}\n"
                                         "kvstore: {device: {bytes: 1GiB}, dtype: bfloat16}\n"))
    assert (config.model.dtype, config.kvstore.dtype) == ("float32", "bfloat16")
    with pytest.raises(ConfigError, match="model.dtype: 'fp8' is not one of \\['auto'"):
        load_config(write(tmp_path, "model: {path: m, dtype: fp8}\nkvstore: {device: {bytes: 1GiB}}\n"))



def test_devices_per_node_become_each_node_s_cuda_visible_devices(tmp_path):
    """Issue 14: `kvrelay up` gives each node the CUDA devices its role's ``devices`` assigns it."""
    from kvrelay.deploy.up import node_env

    path = write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
                           "prefill: {ports: [8100, 8101], devices: [0, 1]}\n"
                           "decode: {ports: [8200], devices: ['2,3']}\n")
    config = load_config(path)
    env = {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert [node_env(env, config, "prefill", i)["CUDA_VISIBLE_DEVICES"] for i in range(2)] == ["0", "1"]
    assert node_env(env, config, "decode", 0) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert node_env(env, config, "router", 0) is env  # the router computes nothing on a GPU
    plain = load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"))
    assert node_env(env, plain, "decode", 0) is env  # no devices assigned: inherited


@pytest.mark.parametrize(("section", "message"), [
    ("prefill: {ports: [8100, 8101], devices: [0]}", "prefill.devices: [0] has 1 entries for 2 nodes (ports)"),
    ("decode: {ports: [8200], devices: [-1]}", "decode.devices: [-1] is not a list of CUDA device indices"),
    ("decode: {ports: [8200], devices: ['gpu0']}", "decode.devices: ['gpu0'] is not a list of CUDA device indices"),
    ("engine: {attention_backend: flash}", "engine.attention_backend: 'flash' is not one of ['reference', 'torch', "
                                           "'triton']"),
    # test-only (the hook in tests/services/hooks): production cannot turn faults on
    ("prefill: {inject_faults: [corrupt_published_block]}", "prefill.inject_faults: unknown key"),
    ("router: {prefill_dns: [kvrelay-prefill]}", "router.prefill_dns: ['kvrelay-prefill'] 'kvrelay-prefill' is not "
                                                 "host:port"),
])
def test_bad_devices_and_dns_names_are_named(tmp_path, section, message):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, f"model: {{path: m}}\nkvstore: {{device: {{bytes: 1GiB}}}}\n{section}\n"))
    assert str(err.value).startswith(message), str(err.value)


def test_integrity_modes_and_a_bare_yaml_off(tmp_path):
    """``off`` unquoted is YAML's false: it still means integrity off. The default is sampled at 0.05."""
    default = load_config(write(tmp_path, "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n")).kvstore
    assert (default.integrity, default.integrity_sample_rate) == ("sampled", 0.05)
    for text, want in (("off", "off"), ("'off'", "off"), ("all", "all")):
        yaml_text = f"model: {{path: m}}\nkvstore: {{device: {{bytes: 1GiB}}, integrity: {text}}}\n"
        cfg = load_config(write(tmp_path, yaml_text))
        assert cfg.kvstore.integrity == want


def test_the_config_knows_every_attention_backend_the_engine_has():
    """deploy reads the names without importing torch; they must stay the engine's."""
    from kvrelay.deploy.service_config import ATTENTION_BACKENDS
    from kvrelay.model.attention import BACKEND_NAME_TO_CLASS

    assert sorted(ATTENTION_BACKENDS) == sorted(BACKEND_NAME_TO_CLASS)


def test_slow_client_timeouts_default_and_are_read(tmp_path):
    """Issue 30: the body-read, write-stall and keep-alive bounds (router, decode nodes, internal plane)."""
    base = "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
    default = load_config(write(tmp_path, base))
    assert (default.router.body_read_timeout_s, default.router.write_stall_timeout_s,
            default.router.keepalive_timeout_s, default.decode.write_stall_timeout_s,
            default.internal.keepalive_timeout_s) == (30.0, 30.0, 75.0, 60.0, 75.0)
    cfg = load_config(write(tmp_path, base + "router: {body_read_timeout_s: 5, write_stall_timeout_s: 2.5, "
                                             "keepalive_timeout_s: 10}\ndecode: {write_stall_timeout_s: 7}\n"
                                             "internal: {keepalive_timeout_s: 20}\n"))
    assert (cfg.router.body_read_timeout_s, cfg.router.write_stall_timeout_s, cfg.router.keepalive_timeout_s,
            cfg.decode.write_stall_timeout_s, cfg.internal.keepalive_timeout_s) == (5.0, 2.5, 10.0, 7.0, 20.0)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, base + "router: {write_stall_timeout_s: 0}\n"))
    assert str(err.value) == "router.write_stall_timeout_s: 0 is not a positive number"


def test_engine_stall_timeout_defaults_to_a_minute_and_must_be_positive(tmp_path):
    base = "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
    assert load_config(write(tmp_path, base)).engine.stall_timeout_s == 60.0
    assert load_config(write(tmp_path, base + "engine: {stall_timeout_s: 2.5}\n")).engine.stall_timeout_s == 2.5
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, base + "engine: {stall_timeout_s: 0}\n"))
    assert str(err.value).startswith("engine.stall_timeout_s: 0 is not a positive number"), str(err.value)


def test_the_tpot_slo_defaults_to_50_ms_and_must_be_a_number_at_least_0(tmp_path):
    """Issue 31: ``router.tpot_slo_s`` bounds the local prefills `auto` takes (`router.plan.tpot_breaches`)."""
    from kvrelay.router.config import RouterConfig

    base = "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
    assert load_config(write(tmp_path, base)).router.tpot_slo_s == 0.05
    assert load_config(write(tmp_path, base + "router: {tpot_slo_s: 0}\n")).router.tpot_slo_s == 0.0
    for bad in ("-1", ".nan", ".inf", "fast"):
        with pytest.raises(ConfigError) as err:
            load_config(write(tmp_path, base + f"router: {{tpot_slo_s: {bad}}}\n"))
        assert str(err.value).startswith("router.tpot_slo_s: ") and str(err.value).endswith("is not a number >= 0")
    assert RouterConfig(model_name="m", model_dir="m").tpot_slo_s == 0.05
    assert load_config(write(tmp_path, base)).router.ttft_slo_s == 0.0
    assert load_config(write(tmp_path, base + "router: {ttft_slo_s: 2.5}\n")).router.ttft_slo_s == 2.5
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, base + "router: {ttft_slo_s: -1}\n"))
    assert str(err.value).startswith("router.ttft_slo_s: ")
    with pytest.raises(ValueError, match="ttft_slo_s must be >= 0 seconds"):
        RouterConfig(model_name="m", model_dir="m", ttft_slo_s=math.inf)
    with pytest.raises(ValueError, match="tpot_slo_s must be >= 0 seconds"):
        RouterConfig(model_name="m", model_dir="m", tpot_slo_s=-0.1)


def test_prefill_nodes_serve_whole_requests_only_when_asked(tmp_path):
    """Issue 31: ``prefill.serve_whole_requests`` (`prefill.service.WholeRequestPrefillService`), a boolean."""
    base = "model: {path: m}\nkvstore: {device: {bytes: 1GiB}}\n"
    assert load_config(write(tmp_path, base)).prefill.serve_whole_requests is False
    on = load_config(write(tmp_path, base + "prefill: {serve_whole_requests: true}\n"))
    assert on.prefill.serve_whole_requests is True
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, base + "prefill: {serve_whole_requests: sometimes}\n"))
    assert str(err.value).startswith("prefill.serve_whole_requests: "), str(err.value)
