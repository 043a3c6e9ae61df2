"""`TieredStore`: the device `BlockPool` plus optional ``host`` and ``disk`` tiers behind one interface.

::

    match_prefix(keys) ─▶ PrefixMatch(num_blocks=5, tiers=(device, device, host, disk, disk))
    load(keys, match)  ─▶ [12, 7, 30, 31, 9]   device block ids, one reference each for the caller:
                          device hits acquired; host/disk hits copied into fresh device blocks

    demotion (on eviction, synchronous unless pre-copied):
    device ──BlockPool.on_evict──▶ host ──HostTier.on_evict──▶ disk (if admitted) ──LRU──▶ gone
       └── maintain_watermark(): pre-copies the coldest cached device blocks to host, so that an
           eviction at allocation time finds them there and copies nothing

* Each tier's ``policy`` (`kvstore.policy`: ``lru`` | ``cold-tail``) says where a new block enters its
  order; cold blocks (past `cold_from`) stay cold as they are demoted, and a prefix hit warms them.
* ``integrity`` (`kvstore.digest`): a block's digest, computed when it is keyed, goes with it to every
  tier (the disk record's checksum is the digest). A promotion checks the bytes that landed on device
  against it (host: every block with ``all``, a sample with ``sampled``) or the record against it (disk:
  every read); a mismatch is a miss: the block is dropped from the tier it came from, counted in
  ``kvrelay_kv_integrity_failures_total{where}``, and recomputed.

* The store constructs the `BlockPool` (as ``block_pool``) with its own ``on_evict`` hook; the engine
  allocates, releases and registers keys through ``store.block_pool`` and computes on ``device_pool``.
* ``host`` is a victim cache: a block promoted from host leaves host. ``disk`` keeps what it holds (a
  block promoted from disk stays there, so demoting it again writes nothing, and it survives restarts).
* Everything runs on the caller's (engine's) thread except the disk writer thread inside `LmdbTier`.
* A disk tier that cannot be opened (the disk is full, not writable, failing) is left out: the store
  serves from device and host, logs why, counts it (``kvrelay_store_disk_open_failures_total{reason}``,
  ``kvrelay_store_disk_available`` 0) and says so in `disk_status` (the node's ``/health``).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from kvrelay.kvstore.admission import parse_admission
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.block_mover import Block, BlockMover, pool_rows
from kvrelay.kvstore.block_pool import BlockPool, PoolStats
from kvrelay.kvstore.block_spec import BlockSpec
from kvrelay.kvstore.checks import require_int
from kvrelay.kvstore.digest import DEFAULT_INTEGRITY, DEFAULT_SAMPLE_RATE, IntegrityPolicy, digest_keyed
from kvrelay.kvstore.fetch_cost import FetchCosts
from kvrelay.kvstore.host_tier import HostTier
from kvrelay.kvstore.lmdb_env import DiskTierUnavailableError
from kvrelay.kvstore.lmdb_tier import DiskStats, LmdbOptions, LmdbTier
from kvrelay.kvstore.metrics import StoreMetrics
from kvrelay.kvstore.policy import DEFAULT_POLICY, TailCap, parse_policy
from kvrelay.kvstore.tier import Tier, TierStats
from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)
TIER_NAMES = ("device", "host", "disk")
# ``local_copy(src_tier, src_ids, dst_tier, dst_ids, *, layers=None) -> path``: moves whole blocks between
# tiers, or with ``layers`` (one layer index per pair) only that layer's slice of each block.
LocalCopy = Callable[..., str]
# Whether a lower tier keeps its copy when a block is promoted to device.
TIER_KEEPS_PROMOTED: dict[str, bool] = {"host": False, "disk": True}


@dataclass(frozen=True, slots=True)
class TieredStoreConfig:
    """Sizes (in blocks, or bytes for disk) and policies of one store.

    ``num_host_blocks == 0`` means no host tier and ``disk_path is None`` no disk tier.
    ``watermark_blocks``: free-or-pre-copied device blocks `maintain_watermark` keeps ready (default
    ``max(1, num_device_blocks // 32)`` with a host tier, else 0). ``admit``: ``"all"`` | ``"seen>=N"``.
    ``device_policy``, ``host_policy``, ``disk_policy``: ``"lru"`` | ``"cold-tail"`` (`kvstore.policy`).
    ``integrity``: ``"off"`` | ``"sampled"`` | ``"all"``, ``integrity_sample_rate`` for ``sampled``
    (`kvstore.digest.IntegrityPolicy`).
    """

    num_device_blocks: int
    num_host_blocks: int = 0
    disk_path: str | None = None
    disk_capacity_bytes: int = 0
    admit: str = "all"
    watermark_blocks: int | None = None
    device: str = "cpu"
    disk_options: LmdbOptions = field(default_factory=LmdbOptions)
    device_policy: str = DEFAULT_POLICY
    host_policy: str = DEFAULT_POLICY
    disk_policy: str = DEFAULT_POLICY
    integrity: str = DEFAULT_INTEGRITY
    integrity_sample_rate: float = DEFAULT_SAMPLE_RATE

    def __post_init__(self) -> None:
        """Raises ValueError naming the field (``kvstore`` in YAML: device/host/disk sizes, ``admit``)."""
        require_int("num_device_blocks", self.num_device_blocks)
        require_int("num_host_blocks", self.num_host_blocks, minimum=0)
        require_int("disk_capacity_bytes", self.disk_capacity_bytes, minimum=0)
        if self.disk_path is not None and self.disk_capacity_bytes == 0:
            raise ValueError(f"a disk tier at {self.disk_path!r} needs disk_capacity_bytes > 0")
        if self.watermark_blocks is not None and not (
                isinstance(self.watermark_blocks, int) and 0 <= self.watermark_blocks <= self.num_device_blocks):
            raise ValueError(f"watermark_blocks must be in [0, num_device_blocks={self.num_device_blocks}], "
                             f"got {self.watermark_blocks!r}")
        parse_admission(self.admit)  # raises ValueError with the accepted spellings
        IntegrityPolicy(self.integrity, self.integrity_sample_rate)  # raises ValueError naming the value
        for tier in TIER_NAMES:
            try:
                parse_policy(getattr(self, f"{tier}_policy"))
            except ValueError as exc:
                raise ValueError(f"{tier}_policy: {exc}") from None

    def policy(self, tier: str) -> str:
        """The normalized policy of ``tier`` (``device`` | ``host`` | ``disk``)."""
        return parse_policy(getattr(self, f"{tier}_policy"))


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest leading run of keys held in any tier.

    ``tiers[i]`` is where block ``i`` was found; ``device_block_ids`` are the device hits' block ids
    in order (``len == tiers.count("device")``).
    """

    num_blocks: int
    tiers: tuple[str, ...]
    device_block_ids: tuple[int, ...]

    def num_hits(self, tier: str) -> int:
        return self.tiers.count(tier)


@dataclass(frozen=True, slots=True)
class TierMove:
    """One block copied from tier ``src`` to tier ``dst`` (for `TieredStore`'s ``on_move`` listener)."""

    key: BlockKey
    src: str
    dst: str


@dataclass(frozen=True, slots=True)
class DiskTierStatus:
    """Whether the store has its disk tier: ``state`` ``"open"`` (at ``path``), ``"unavailable"`` (configured
    at ``path`` but not usable; ``reason`` says why and what to do) or ``"none"`` (not configured)."""

    state: str
    path: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class StoreStats:
    device: PoolStats
    block_bytes: int
    host: TierStats | None
    disk: DiskStats | None
    queries: int
    tier_to_hits: dict[str, int]


class TieredStore:
    """Device pool + optional host and disk tiers.

    Args:
        spec: block layout.
        config: sizes and policies.
        device_pool: the device pool tensor ``spec.pool_shape(config.num_device_blocks)``; allocated on
            ``config.device`` when None.
        registry: Prometheus registry for this store's metrics (a new one when None).
        on_move: called with every `TierMove`, after the copy is issued.

    Raises:
        ValueError: sizes, admission policy or ``device_pool`` shape are wrong.
        DiskTierInUseError: another process owns the disk path (two nodes given one path: a config error).
    """

    def __init__(
        self, spec: BlockSpec, config: TieredStoreConfig, *, device_pool: torch.Tensor | None = None,
        registry: CollectorRegistry | None = None, on_move: Callable[[TierMove], None] | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        self._admission = parse_admission(config.admit)
        if device_pool is None:
            device_pool = spec.new_pool(config.num_device_blocks, device=config.device)
        want_shape = spec.pool_shape(config.num_device_blocks)
        if tuple(device_pool.shape) != want_shape:
            raise ValueError(f"device pool shape {tuple(device_pool.shape)} != {want_shape}")
        self.device_pool = device_pool
        self._device_rows = pool_rows(device_pool)  # CPU pool: cheap per-block byte views for copies
        self.metrics = StoreMetrics.create(registry)
        self.integrity = IntegrityPolicy(config.integrity, config.integrity_sample_rate)
        self._rng = random.Random()  # which blocks ``sampled`` checks
        self.block_pool = BlockPool(config.num_device_blocks, on_evict=self._on_device_evict,
                                    honour_cold=config.policy("device") == "cold-tail",
                                    digester=self.digest_device_blocks if self.integrity.enabled else None)
        self.host = (
            HostTier(spec, config.num_host_blocks, on_evict=self._on_host_evict,
                     honour_cold=config.policy("host") == "cold-tail")
            if config.num_host_blocks else None
        )
        disk_options = (dataclasses.replace(config.disk_options, checksum="xxh3") if self.integrity.enabled
                        else config.disk_options)  # an xxh3 record's checksum is the block digest
        self.disk: LmdbTier | None = None
        self._disk_unavailable: str | None = None  # why the configured disk tier could not be opened
        if config.disk_path is not None:
            try:
                self.disk = LmdbTier(spec, config.disk_path, capacity_bytes=config.disk_capacity_bytes,
                                     metrics=self.metrics, options=disk_options)
            except DiskTierUnavailableError as exc:
                self._disk_unavailable = str(exc)
                self.metrics.disk_open_failures.labels(exc.reason_code).inc()
                log.error("%s; serving from the device and host tiers without it", exc)
        self.metrics.disk_available.set(1 if self.disk is not None else 0)
        if self.disk is not None:
            self.disk.on_corrupt = lambda key, problem: self.integrity_failure("disk", key, problem)
        # Lookup and promotion walk the lower tiers in this order.
        self._lower: dict[str, Tier] = {n: t for n, t in (("host", self.host), ("disk", self.disk)) if t is not None}
        self._disk_drops_cold = self.disk is not None and config.policy("disk") == "cold-tail"
        uses_cold = any(config.policy(t) == "cold-tail" for t in ("device", *self._lower))
        total_blocks = (config.num_device_blocks + config.num_host_blocks
                        + (config.disk_capacity_bytes // spec.block_bytes if self.disk is not None else 0))
        self.tail_cap = TailCap(total_blocks) if uses_cold else None
        self.metrics.tail_blocks.set(-1)
        default_watermark = max(1, config.num_device_blocks // 32) if self.host is not None else 0
        self.watermark_blocks = config.watermark_blocks if config.watermark_blocks is not None else default_watermark
        self._mover = BlockMover(device_pool.device)
        self._on_move = on_move
        self._closed = False
        self.local_copy_paths: dict[str, int] = {}  # device<->host moves by path ("nixl" | "torch")
        self.local_copy: LocalCopy | None = None  # the node's NIXL loopback copy, once attached
        self._queries = 0
        self._tier_to_hits = dict.fromkeys(TIER_NAMES, 0)
        self.fetch_costs = FetchCosts()  # the engine sets recompute_s from its prefill rate
        self._set_gauges()

    def _set_gauges(self) -> None:
        """``kvrelay_kv_blocks`` and ``kvrelay_kv_bytes`` (blocks x this node's block bytes) per tier and state,
        read at each scrape."""
        pool = self.block_pool
        counts: dict[tuple[str, str], Callable[[], int]] = {
            ("device", "free"): lambda: pool.stats().num_free,
            ("device", "cached"): lambda: pool.stats().num_cached,
            ("device", "in_use"): lambda: pool.stats().num_in_use,
        }
        for name, tier in self._lower.items():
            counts[(name, "stored")] = lambda t=tier: t.stats().num_blocks
            counts[(name, "free")] = lambda t=tier: max(0, t.stats().capacity_blocks - t.stats().num_blocks)
        block_bytes = self.spec.block_bytes
        for labels, count in counts.items():
            self.metrics.kv_blocks.labels(*labels).set_function(count)
            self.metrics.kv_bytes.labels(*labels).set_function(lambda c=count: c() * block_bytes)

    @property
    def disk_status(self) -> DiskTierStatus:
        """Whether the disk tier is open, unavailable (and why) or not configured. Any thread."""
        path = self.config.disk_path
        if path is None:
            return DiskTierStatus("none")
        reason = self._disk_unavailable or (self.disk.unavailable_reason if self.disk is not None else None)
        return DiskTierStatus("open", path) if reason is None else DiskTierStatus("unavailable", path, reason)

    # ------------------------------------------------------------------ lookup
    def match_prefix(self, keys: Sequence[BlockKey]) -> PrefixMatch:
        """The longest leading run of ``keys`` found tier by tier; changes no ref count and no LRU.

        Counts ``len(keys)`` queried blocks and the run's hits per tier; each key counts as seen once
        for the admission policy.
        """
        tiers: list[str] = []
        device_ids: list[int] = []
        for key in keys:
            block_id = self.block_pool.block_id_of(key)
            if block_id is not None:
                tiers.append("device")
                device_ids.append(block_id)
                continue
            found = next((name for name, tier in self._lower.items() if tier.contains(key)), None)
            if found is None:
                break
            tiers.append(found)
        self._admission.record_seen(keys)
        match = PrefixMatch(len(tiers), tuple(tiers), tuple(device_ids))
        self._count_query(len(keys), match)
        return match

    def cold_from(self, keys: Sequence[BlockKey], num_hit: int) -> int | None:
        """Once per prompt, after `load`: ``keys`` as given to `match_prefix`, ``num_hit`` blocks loaded.
        The index of the prompt's first block to key cold (``register_key(..., cold=True)``), or None
        when none is (no tier uses ``cold-tail``, or `TailCap` chose no cap)."""
        if self.tail_cap is None:
            return None
        m = self.tail_cap.observe(keys)
        self.metrics.tail_blocks.set(-1 if m is None else m)
        return None if m is None else num_hit + m

    def _count_query(self, num_keys: int, match: PrefixMatch) -> None:
        self._queries += num_keys
        self.metrics.prefix_queries.inc(num_keys)
        deltas = {"queries": num_keys}
        for name in TIER_NAMES:
            n = match.num_hits(name)
            if n:
                self._tier_to_hits[name] += n
                self.metrics.prefix_hits.labels(name).inc(n)
                deltas[f"hits.{name}"] = n
        if self.disk is not None:
            self.disk.add_counters(deltas)

    def record_prompt(self, num_prompt_tokens: int, num_matched_tokens: int) -> None:
        """Count a prompt, and count it in ``kvrelay_prefix_shorter_than_block_total`` when it got less
        than one block from the cache because what it could share is shorter than one block: it has no
        full block before its last token (``num_prompt_tokens - 1 < block_size_tokens``), or the caller
        knows it shares ``0 < num_matched_tokens < block_size_tokens`` tokens with an earlier prompt.
        """
        self.metrics.prompts.inc()
        b = self.spec.block_size_tokens
        if num_matched_tokens < b and (num_prompt_tokens - 1 < b or num_matched_tokens > 0):
            self.metrics.prefix_shorter_than_block.inc()

    # --------------------------------------------------------------- promotion
    def load(self, keys: Sequence[BlockKey], match: PrefixMatch) -> list[int]:
        """Device block ids for the first ``match.num_blocks`` keys, each with one reference for the caller.

        Device hits are acquired; host and disk hits are copied into newly allocated device blocks that
        are registered under their key. Each block is looked up again (it may have moved since
        `match_prefix`). If one cannot be loaded (no free device block, a disk record corrupt or
        unreadable), the shorter run before it is returned and nothing after it stays held: the caller
        computes the rest. The run is cut where fetching the rest from the lower tiers is predicted slower
        than recomputing it (`fetch_costs`, `kvstore.fetch_cost`; counted in
        ``kvrelay_store_fetch_skipped_blocks_total``).
        """
        skipped = match.num_blocks - self.fetch_costs.worth_loading(match.tiers)
        if skipped:
            self.metrics.fetch_skipped.inc(skipped)
        keys = list(keys[: match.num_blocks - skipped])
        block_ids: list[int | None] = [self.block_pool.block_id_of(k) for k in keys]
        held = [b for b in block_ids if b is not None]
        self.block_pool.acquire(held)
        self.block_pool.warm(held)  # a prefix hit: no longer cold
        end = len(keys)
        for i, key in enumerate(keys):
            if block_ids[i] is not None:
                continue
            got = self.block_pool.try_allocate(1)
            if got is None:
                end = i
                break
            if not self._promote(key, got[0]):
                self.block_pool.release(got)
                end = i
                break
            block_ids[i] = got[0]
        self.block_pool.release([b for b in block_ids[end:] if b is not None])
        return [b for b in block_ids[:end] if b is not None]

    def _promote(self, key: BlockKey, block_id: int) -> bool:
        """Copy ``key``'s block from the highest lower tier holding it into device block ``block_id``.

        With integrity on, the landed bytes are checked against the digest the block came with (host:
        the device block is hashed; disk: `LmdbTier.get_into` checks the record, whose checksum is the
        digest); a mismatch drops the block from that tier and counts it (`integrity_failure`).
        """
        dst = self._device_block(block_id)
        for name, tier in self._lower.items():
            if not tier.contains(key):
                continue
            if name == "host":
                self._mover.order_after_copy_into(self.host.slot_of(key))  # type: ignore[union-attr,arg-type]
            want = tier.digest_of(key)
            t0 = time.perf_counter()
            if not tier.get_into(key, dst):
                continue  # disk: a bad record was dropped and counted (on_corrupt)
            digest = want if want is not None else tier.digest_of(key)  # disk: known once its record was read
            if name == "disk" and digest is not None:
                self.integrity_checked("disk", 1)
            if name == "host" and want is not None and self.integrity.pick(1, self._rng):
                self.integrity_checked("host", 1)
                got = self.digest_device_blocks([block_id], [key])[0]
                if got != want:
                    tier.discard(key)
                    self.integrity_failure("host", key, f"digest {got:016x}, expected {want:016x}")
                    continue  # a lower tier may hold a good copy
            if digest is None and self.integrity.enabled:  # put without one (integrity was off, an old record)
                digest = self.digest_device_blocks([block_id], [key])[0]
            self.fetch_costs.observe(name, time.perf_counter() - t0)
            if not TIER_KEEPS_PROMOTED[name]:
                tier.discard(key)
            registered = self.block_pool.register_key(block_id, key, digest=digest)
            assert registered, "a promoted key was already on device"
            self._moved(key, name, "device")
            return True
        return False

    # --------------------------------------------------------------- integrity
    def digest_device_blocks(self, block_ids: Sequence[int], keys: Sequence[BlockKey]) -> list[int]:
        """The digests of device blocks ``block_ids`` under ``keys`` (one batch; one launch on CUDA)."""
        return digest_keyed(self.device_pool, block_ids, keys)

    def integrity_checked(self, where: str, num_blocks: int) -> None:
        """Count ``num_blocks`` blocks checked against their digests at ``where``."""
        self.metrics.integrity_checks.labels(where).inc(num_blocks)

    def integrity_failure(self, where: str, key: BlockKey, detail: str, num_blocks: int = 1) -> None:
        """Count and log a block whose bytes did not match its digest where it landed (``where``: one of
        `kvstore.digest.INTEGRITY_WHERE`). The caller has dropped it; its tokens are recomputed."""
        self.metrics.integrity_failures.labels(where).inc(num_blocks)
        log.error("KV integrity: block %s failed its check at %s (%s); dropped, its tokens are recomputed",
                  key.hex(), where, detail)

    # ---------------------------------------------------------------- demotion
    def _on_device_evict(self, block_id: int, key: BlockKey) -> None:
        """BlockPool hook: ``key`` leaves device block ``block_id`` (bytes still intact)."""
        src = self._device_block(block_id)
        cold = self.block_pool.is_cold(block_id)
        digest = self.block_pool.digest_of(block_id)
        if self.host is not None:
            slot = self.host.slot_of(key)
            if slot is not None:  # pre-copied by maintain_watermark: put copies nothing, refreshes if warm
                self.host.put(key, src, cold=cold)
                self._mover.order_after_copy_into(slot)
                return
            if self.host.put(key, src, cold=cold, digest=digest):
                self._mover.copied_into(self.host.slot_of(key))  # type: ignore[arg-type]
                self._moved(key, "device", "host")
            elif self.disk is not None:  # every host slot is reserved by long-context offloads
                self._demote_to_disk(key, src, "device", cold, digest)
            else:
                self.metrics.tier_evictions.labels("device").inc()
        elif self.disk is not None:
            self._demote_to_disk(key, src, "device", cold, digest)
        else:
            self.metrics.tier_evictions.labels("device").inc()

    def _on_host_evict(self, slot: int, key: BlockKey) -> None:
        """HostTier hook: ``key`` leaves host ``slot`` (bytes still intact)."""
        if self.disk is None:
            self.metrics.tier_evictions.labels("host").inc()
            return
        self._mover.before_cpu_read(slot)
        host = self.host
        assert host is not None
        self._demote_to_disk(key, host.block(slot), "host", host.is_cold(key), host.digest_of(key))

    def _device_block(self, block_id: int) -> Block:
        return self._device_rows[block_id] if self._device_rows is not None else self.device_pool[block_id]

    def _demote_to_disk(self, key: BlockKey, src: Block, src_tier: str, cold: bool, digest: int | None) -> None:
        assert self.disk is not None
        if cold and self._disk_drops_cold:  # predicted not reused: neither written nor refreshed
            if not self.disk.contains(key):
                self.metrics.tier_evictions.labels(src_tier).inc()
            return
        if self.disk.touch(key):
            return  # already stored: disk keeps promoted blocks
        if self._admission.admit(key) and self.disk.put(key, src, digest=digest):
            self._moved(key, src_tier, "disk")
        else:
            self.metrics.tier_evictions.labels(src_tier).inc()

    def maintain_watermark(self) -> int:
        """Pre-copy the coldest cached device blocks to host until ``watermark_blocks`` device blocks are
        free or already on host. Call once per engine step; cheap when nothing is to do. On CUDA the
        copies run on a side stream. Returns how many blocks were copied.
        """
        if self.host is None or self.watermark_blocks == 0:
            return 0
        want = self.watermark_blocks - self.block_pool.stats().num_free
        if want <= 0:
            return 0
        todo: list[tuple[int, BlockKey]] = []
        # A cold block put into a full cold-tail host is its next victim, pushed out by the next pre-copy:
        # copy cold ones only into free slots (the rest are copied, or dropped, when evicted).
        cold_slots = self.host.num_free_slots if self.host.honour_cold else self.host.num_blocks
        for block_id in self.block_pool.coldest_cached(want):
            key = self.block_pool.key_of(block_id)
            if key is None or self.host.contains(key):
                continue
            if self.block_pool.is_cold(block_id):
                if cold_slots <= 0:
                    continue
                cold_slots -= 1
            todo.append((block_id, key))
        if not todo:
            return 0
        with self._mover.precopy_stream():
            for block_id, key in todo:
                if not self.host.put(key, self._device_block(block_id), cold=self.block_pool.is_cold(block_id),
                                     digest=self.block_pool.digest_of(block_id)):
                    break  # every host slot is reserved by long-context offloads
                self._mover.copied_into(self.host.slot_of(key))  # type: ignore[arg-type]
                self._moved(key, "device", "host")
        return len(todo)

    def _moved(self, key: BlockKey, src: str, dst: str) -> None:
        self.metrics.tier_moves.labels(src, dst).inc()
        if self._on_move is not None:
            self._on_move(TierMove(key, src, dst))

    # ------------------------------------------------------------- local moves
    def attach_local_copy(self, local_copy: LocalCopy) -> None:
        """Send device<->host block moves through ``local_copy(src_tier, [src_id], dst_tier, [dst_id])``
        (the node's NIXL agent as a loopback transfer, so one path moves every byte). Moves of bytes
        that are not whole blocks of the two registered pools keep the plain copy. Call before use.
        """
        if self.host is None:
            return
        self.local_copy = local_copy
        fallback = self.host.copy
        block_bytes = self.spec.block_bytes
        pools = (("device", self.device_pool), ("host", self.host.pool))

        def locate(block: Block) -> tuple[str, int] | None:
            if isinstance(block, torch.Tensor):
                ptr, nbytes = block.data_ptr(), block.numel() * block.element_size()
            else:
                ptr, nbytes = block.__array_interface__["data"][0], block.nbytes
            for name, pool in pools:
                offset = ptr - pool.data_ptr()
                if nbytes == block_bytes and 0 <= offset < pool.numel() * pool.element_size() \
                        and offset % block_bytes == 0:
                    return name, offset // block_bytes
            return None

        def copy(dst: Block, src: Block) -> None:
            d, s = locate(dst), locate(src)
            if d is None or s is None:
                fallback(dst, src)
                return
            try:
                path = local_copy(s[0], [s[1]], d[0], [d[1]])
            except Exception:  # noqa: BLE001 - the destination's bytes are unknown: copy them again
                log.exception("loopback copy %s -> %s failed; copying with torch", s, d)
                fallback(dst, src)
                path = "torch"
            self.local_copy_paths[path] = self.local_copy_paths.get(path, 0) + 1

        self.host.copy = copy

    # ------------------------------------------------------------ housekeeping
    def persist(self, *, timeout_s: float = 300.0) -> int:
        """Write every keyed device and host block that disk lacks (ignoring admission), then flush, all
        within ``timeout_s``.

        For a planned shutdown. Returns how many blocks were queued; 0 without a disk tier (or with one
        that became unavailable).

        Raises:
            TimeoutError: the disk writer did not commit them within ``timeout_s``.
        """
        if self.disk is None or self.disk.unavailable_reason is not None:
            return 0
        deadline = time.monotonic() + timeout_s
        written = 0
        sources: list[tuple[BlockKey, Block, int | None]] = []
        for block_id in range(self.block_pool.num_blocks):
            key = self.block_pool.key_of(block_id)
            if key is not None:
                sources.append((key, self._device_block(block_id), self.block_pool.digest_of(block_id)))
        if self.host is not None:
            for key in self.host.keys_lru_first():
                slot = self.host.slot_of(key)
                self._mover.before_cpu_read(slot)  # type: ignore[arg-type]
                sources.append((key, self.host.block(slot), self.host.digest_of(key)))  # type: ignore[arg-type]
        if self._mover.is_cuda:
            torch.cuda.synchronize()
        for key, src, digest in sources:
            if self.disk.contains(key):
                continue
            if not self.disk.put(key, src, digest=digest):  # queue full: let the writer catch up once
                self.disk.flush(max(0.0, deadline - time.monotonic()))
                if not self.disk.put(key, src, digest=digest):
                    continue
            written += 1
        self.disk.flush(max(0.0, deadline - time.monotonic()))
        return written

    def flush(self, timeout_s: float = 30.0) -> None:
        """Wait until queued disk writes are committed (no-op without a disk tier)."""
        if self.disk is not None:
            self.disk.flush(timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Commit queued disk writes and close the disk tier. Device and host contents are dropped."""
        self._closed = True
        if self.disk is not None:
            self.disk.close()

    def stats(self) -> StoreStats:
        return StoreStats(
            self.block_pool.stats(), self.spec.block_bytes,
            self.host.stats() if self.host is not None else None,
            self.disk.disk_stats() if self.disk is not None else None,
            self._queries, dict(self._tier_to_hits),
        )

    def check_integrity(self) -> None:
        """`check_integrity` of every tier (the disk tier's flushes first).

        Raises:
            AssertionError: naming the first inconsistency found.
        """
        self.block_pool.check_integrity()
        for tier in self._lower.values():
            tier.check_integrity()
