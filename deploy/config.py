"""YAML config → frozen dataclasses: the only place that reads the config file (``yaml.safe_load``).

`load_config` reads one file with these sections (see ``deploy/configs/``)::

    model, engine, internal, prefill, decode, router      →  deploy.service_config
    kvstore:                                              →  KvStoreConfig (here)
      block_size_tokens: 16
      dtype: bfloat16                    # optional: the KV dtype; absent = the model's weights dtype
      device: {bytes: 4GiB}              # or {fraction_of_free: 0.2}: of the memory free at start (absent:
                                         # 0.2 on CPU, 0.85 of free GPU memory on CUDA, through NVML)
      host: {bytes: 16GiB}               # or {fraction_of_free: 0.1} of host memory; no host tier when absent
      disk: {path: /var/lib/kvrelay/kv, bytes: 200GiB, admit: "seen>=2"}   # optional; admit: all | seen>=N
      # each tier also takes policy: cold-tail (default) | lru  (kvstore/policy.py; README "Tier policy")
      integrity: sampled                 # off | sampled (default) | all: block digests checked where blocks land
      integrity_sample_rate: 0.05        # with sampled: the share of landed blocks checked (kvstore/digest.py)

Sizes are integers (bytes) or strings with a binary unit (``"4096"``, ``512MiB``, ``8GiB``, ``1.5TiB``).
A ``fraction_of_free`` is of the memory free when the node starts (`deploy.memory`): host memory for the host
tier and for a CPU device tier (the node's share of it, under `kvrelay up`), GPU memory for a CUDA one.
Relative paths resolve from the working directory. Every bad value or unknown key raises `ConfigError`
naming its key path, e.g. ``kvstore.disk.bytes: '8GB' is not a size; use e.g. "8GiB"``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from deploy.memory import free_host_bytes, nvml_free_bytes
from deploy.service_config import (
    DecodeSection,
    EngineSection,
    InternalSection,
    ModelSection,
    ObservabilitySection,
    PrefillSection,
    RouterSection,
    Section,
    one_of,
    parse_services,
    positive_int,
    size,
    string,
)
from deploy.sizes import ConfigError
from kvstore.admission import parse_admission
from kvstore.digest import DEFAULT_INTEGRITY, DEFAULT_SAMPLE_RATE, INTEGRITY_MODES
from kvstore.policy import DEFAULT_POLICY, POLICY_NAMES, parse_policy
from model.dtype_names import DTYPE_NAMES

if TYPE_CHECKING:  # the store's types load torch; the router process reads this config without them
    from kvstore.block_spec import BlockSpec
    from kvstore.tiered_store import TieredStoreConfig

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "local.yaml"
GpuFreeBytes = Callable[[], int]
# kvstore.device without bytes or fraction_of_free: this share of the memory free at start. On CPU the device and
# host tiers share host memory with the weights, activations and the OS, so less than a GPU's share.
DEFAULT_DEVICE_FRACTION = {"cpu": 0.2, "cuda": 0.85}

__all__ = ["DEFAULT_CONFIG", "Config", "ConfigError", "KvStoreConfig", "for_node", "load_config", "node_names",
           "parse_config"]


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


# ---------------------------------------------------------------- dataclasses
@dataclass(frozen=True, slots=True)
class DeviceTierConfig:
    """At most one of ``size_bytes`` and ``free_memory_frac`` is set; neither: `DEFAULT_DEVICE_FRACTION`."""

    size_bytes: int | None = None
    free_memory_frac: float | None = None
    policy: str = DEFAULT_POLICY

    def fraction(self, device: str) -> float | None:
        """The share of free memory this tier takes on ``device``; None when sized in bytes."""
        if self.size_bytes is not None:
            return None
        if self.free_memory_frac is not None:
            return self.free_memory_frac
        return DEFAULT_DEVICE_FRACTION["cuda" if is_cuda(device) else "cpu"]

    def resolve_bytes(self, device: str = "cpu", *, host_free_bytes: Callable[[], int] = free_host_bytes,
                      gpu_free_bytes: GpuFreeBytes = nvml_free_bytes) -> int:
        """Bytes for the device pool: ``size_bytes``, or its fraction of the memory free now: GPU memory on
        CUDA (call it after the weights are loaded, like ``gpu_memory_utilization``), else host memory."""
        frac = self.fraction(device)
        if frac is None:
            assert self.size_bytes is not None
            return self.size_bytes
        return int((gpu_free_bytes() if is_cuda(device) else host_free_bytes()) * frac)


@dataclass(frozen=True, slots=True)
class HostTierConfig:
    """Exactly one of ``size_bytes`` and ``free_memory_frac`` (of free host memory) is set."""

    size_bytes: int | None = None
    policy: str = DEFAULT_POLICY
    free_memory_frac: float | None = None

    def resolve_bytes(self, *, host_free_bytes: Callable[[], int] = free_host_bytes) -> int:
        if self.size_bytes is not None:
            return self.size_bytes
        assert self.free_memory_frac is not None
        return int(host_free_bytes() * self.free_memory_frac)


@dataclass(frozen=True, slots=True)
class DiskTierConfig:
    path: str
    size_bytes: int
    admit: str = "all"
    policy: str = DEFAULT_POLICY


@dataclass(frozen=True, slots=True)
class KvStoreConfig:
    device: DeviceTierConfig
    block_size_tokens: int = 16
    host: HostTierConfig | None = None
    disk: DiskTierConfig | None = None
    dtype: str | None = None  # KV dtype; None: the model's weights dtype
    integrity: str = DEFAULT_INTEGRITY  # off | sampled | all (kvstore.digest.IntegrityPolicy)
    integrity_sample_rate: float = DEFAULT_SAMPLE_RATE

    def device_num_blocks(self, block_bytes: int, gpu_free_bytes: GpuFreeBytes = nvml_free_bytes, *,
                          device: str = "cuda", host_free_bytes: Callable[[], int] = free_host_bytes) -> int:
        """Device blocks of ``block_bytes`` that fit the device tier on ``device``.

        Raises:
            ConfigError: not even one.
        """
        device_bytes = self.device.resolve_bytes(device, host_free_bytes=host_free_bytes,
                                                 gpu_free_bytes=gpu_free_bytes)
        if device_bytes < block_bytes:
            key = "bytes" if self.device.size_bytes is not None else "fraction_of_free"
            raise ConfigError(
                f"kvstore.device.{key}: {device_bytes} bytes hold no {block_bytes}-byte KV block; raise it"
            )
        return device_bytes // block_bytes

    def store_config(
        self, spec: BlockSpec, *, device: str = "cpu", gpu_free_bytes: GpuFreeBytes = nvml_free_bytes,
        host_free_bytes: Callable[[], int] = free_host_bytes,
    ) -> TieredStoreConfig:
        """Sizes in blocks of ``spec`` for `kvstore.tiered_store.TieredStore`. ``host_free_bytes()``: the host
        memory a ``fraction_of_free`` is of (read once here; `kvrelay up` passes each node its share).

        Raises:
            ConfigError: the device tier holds no block, or ``spec`` has another block size.
        """
        from kvstore.tiered_store import TieredStoreConfig

        if spec.block_size_tokens != self.block_size_tokens:
            raise ConfigError(
                f"kvstore.block_size_tokens: {self.block_size_tokens} but the model's KV blocks have "
                f"{spec.block_size_tokens} tokens"
            )
        free = _Once(host_free_bytes)
        host_bytes = self.host.resolve_bytes(host_free_bytes=free) if self.host is not None else 0
        return TieredStoreConfig(
            num_device_blocks=self.device_num_blocks(spec.block_bytes, gpu_free_bytes, device=device,
                                                     host_free_bytes=free),
            num_host_blocks=host_bytes // spec.block_bytes,
            disk_path=self.disk.path if self.disk is not None else None,
            disk_capacity_bytes=self.disk.size_bytes if self.disk is not None else 0,
            admit=self.disk.admit if self.disk is not None else "all",
            device=device,
            device_policy=self.device.policy,
            host_policy=self.host.policy if self.host is not None else DEFAULT_POLICY,
            disk_policy=self.disk.policy if self.disk is not None else DEFAULT_POLICY,
            integrity=self.integrity, integrity_sample_rate=self.integrity_sample_rate,
        )


class _Once:
    """A reading taken at the first call and repeated after: both tiers' fractions are of one figure."""

    def __init__(self, read: Callable[[], int]) -> None:
        self._read = read
        self._value: int | None = None

    def __call__(self) -> int:
        if self._value is None:
            self._value = self._read()
        return self._value


@dataclass(frozen=True, slots=True)
class Config:
    """The whole config file, one field per section."""

    model: ModelSection
    kvstore: KvStoreConfig
    engine: EngineSection
    internal: InternalSection
    prefill: PrefillSection
    decode: DecodeSection
    router: RouterSection
    observability: ObservabilitySection = ObservabilitySection()


# -------------------------------------------------------------------- kvstore
def _integrity(v: Any) -> str:
    if v is False:  # YAML 1.1 reads a bare ``off`` as false
        return "off"
    if v not in INTEGRITY_MODES:
        raise ValueError(f"is not one of {list(INTEGRITY_MODES)}")
    return str(v)


def _fraction(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v <= 1:
        raise ValueError("is not a fraction in (0, 1]")
    return float(v)


def _admission(v: Any) -> str:
    try:
        parse_admission(v)
    except ValueError:
        raise ValueError('is not an admission policy; use "all" or "seen>=N" with N >= 1, e.g. "seen>=2"') from None
    return v.strip()


def _policy(v: Any) -> str:
    try:
        return parse_policy(v)
    except ValueError:
        raise ValueError(f"is not a tier policy; use one of {', '.join(POLICY_NAMES)}") from None


def parse_kvstore(root: Section, *, base_dir: Path) -> KvStoreConfig:
    """Read the ``kvstore`` section of ``root`` (the tiers are sized in bytes later, when a node starts:
    `KvStoreConfig.store_config`).

    Raises:
        ConfigError: naming the key path of the first bad value or unknown key.
    """
    k = root.section("kvstore")
    block_size_tokens = k.take("block_size_tokens", positive_int, 16)
    kv_dtype = k.take("dtype", one_of(DTYPE_NAMES), None)
    integrity = k.take("integrity", _integrity, DEFAULT_INTEGRITY)
    sample_rate = k.take("integrity_sample_rate", _fraction, DEFAULT_SAMPLE_RATE)
    d = k.section("device")
    device = DeviceTierConfig(d.take("bytes", size, None), d.take("fraction_of_free", _fraction, None),
                              d.take("policy", _policy, DEFAULT_POLICY))
    d.done()
    if device.size_bytes is not None and device.free_memory_frac is not None:
        raise ConfigError('kvstore.device: set one of bytes (e.g. 8GiB) and fraction_of_free (e.g. 0.2), not both')
    h = k.section("host")
    host_bytes, host_frac = h.take("bytes", size, None), h.take("fraction_of_free", _fraction, None)
    host_policy = h.take("policy", _policy, None)
    h.done()
    if host_bytes is not None and host_frac is not None:
        raise ConfigError('kvstore.host: set one of bytes (e.g. 16GiB) and fraction_of_free (e.g. 0.1), not both')
    if host_policy is not None and host_bytes is None and host_frac is None:
        raise ConfigError("kvstore.host.policy: there is no host tier; set kvstore.host.bytes, e.g. 16GiB")
    s = k.section("disk")
    disk_path, disk_bytes, admit = s.take("path", string, None), s.take("bytes", size, None), s.take(
        "admit", _admission, "all"
    )
    disk_policy = s.take("policy", _policy, None)
    s.done()
    if disk_policy is not None and disk_path is None and disk_bytes is None:
        raise ConfigError("kvstore.disk.policy: there is no disk tier; set kvstore.disk.path and bytes")
    disk = None
    if disk_path is not None or disk_bytes is not None:
        for name, value, example in (("path", disk_path, "/var/lib/kvrelay/kv"), ("bytes", disk_bytes, "200GiB")):
            if value is None:
                raise ConfigError(f"kvstore.disk.{name}: required with a disk tier; e.g. {example}")
        assert disk_path is not None and disk_bytes is not None
        disk = DiskTierConfig(str(base_dir / Path(disk_path).expanduser()), disk_bytes, admit,
                              disk_policy or DEFAULT_POLICY)
    k.done()
    host = (HostTierConfig(host_bytes, host_policy or DEFAULT_POLICY, host_frac)
            if host_bytes is not None or host_frac is not None else None)
    return KvStoreConfig(device, block_size_tokens, host, disk, kv_dtype, integrity, sample_rate)


# ---------------------------------------------------------------------- nodes
def node_names(config: Config) -> list[str]:
    """The engine nodes a config runs: ``prefill-0 …``, then ``decode-0 …``."""
    return ([f"prefill-{i}" for i in range(len(config.prefill.ports))]
            + [f"decode-{i}" for i in range(len(config.decode.ports))])


def for_node(kv: KvStoreConfig, node: str) -> KvStoreConfig:
    """``kv`` as node ``node`` uses it: its disk tier in its own subdirectory (one LMDB environment per process)."""
    if kv.disk is None:
        return kv
    return dataclasses.replace(kv, disk=dataclasses.replace(kv.disk, path=str(Path(kv.disk.path) / node)))


# ---------------------------------------------------------------------- files
def parse_config(
    data: Any, *, base_dir: Path, gpu_free_bytes: GpuFreeBytes = nvml_free_bytes, env: Mapping[str, str] | None = None
) -> Config:
    """A `Config` from already-loaded YAML ``data``.

    Raises:
        ConfigError: naming the key path of the first bad value or unknown key.
    """
    root = Section(data, "")
    kvstore = parse_kvstore(root, base_dir=base_dir)
    services = parse_services(root, base_dir=base_dir, env=env)
    root.done()
    if is_cuda(services["model"].device) and kvstore.device.size_bytes is None:
        try:  # the pool is sized at the node's start; a machine without NVML fails now, naming the key
            gpu_free_bytes()
        except Exception as exc:  # noqa: BLE001 - NVML missing or failing
            raise ConfigError(
                f"kvstore.device.fraction_of_free: cannot read free GPU memory through NVML "
                f'({type(exc).__name__}: {exc}); set kvstore.device.bytes instead, e.g. "8GiB"'
            ) from None
    long_context = services["decode"].long_context
    try:
        long_context.check(kvstore.block_size_tokens)
    except ValueError as exc:
        raise ConfigError(f"decode.{exc}") from None
    if long_context.policy == "infinigen" and kvstore.host is None:
        raise ConfigError("decode.long_context.policy: infinigen offloads to the host tier; set kvstore.host.bytes")
    return Config(kvstore=kvstore, **services)


def load_config(
    path: str | Path, *, model_path: str | None = None, router_port: int | None = None,
    gpu_free_bytes: GpuFreeBytes = nvml_free_bytes,
) -> Config:
    """Read and validate the YAML file at ``path``; ``model_path``/``router_port`` override
    ``model.path``/``router.port``. Relative paths resolve from the working directory.

    Raises:
        ConfigError: unreadable file, invalid YAML, or a bad value (the message names the key path).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read config file ({exc.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (model, kvstore, ...)")
    data = dict(data)
    for section, key, value in (("model", "path", model_path), ("router", "port", router_port)):
        if value is not None:
            data[section] = {**(data.get(section) or {}), key: value}
    return parse_config(data, base_dir=Path.cwd(), gpu_free_bytes=gpu_free_bytes)
