"""Prometheus metrics of one `TieredStore`.

Metric objects are created per store in the `CollectorRegistry` the caller passes (a new one by
default), never in the process-wide default registry, so several stores (and tests) in one process do
not collide. ``deploy/`` exposes the registry on ``/metrics``.

=============================================  ============  ===========================================
name                                           labels        meaning
=============================================  ============  ===========================================
``kvrelay_kv_blocks``                          tier, state   blocks now per tier and state (gauge)
``kvrelay_kv_bytes``                           tier, state   the same in bytes: blocks x block bytes (gauge)
``kvrelay_prefix_cache_queries_total``                       blocks looked up by `match_prefix`
``kvrelay_prefix_cache_hits_total``            tier          blocks of the matched run, by tier
``kvrelay_tier_moves_total``                   src, dst      blocks copied between tiers
``kvrelay_tier_evictions_total``               tier          blocks dropped from a tier for good
``kvrelay_store_corrupt_total``                              disk values or environments found corrupt
``kvrelay_store_dropped_writes_total``                       disk writes dropped (queue full, no room,
                                                             a write back-off, the tier unavailable)
``kvrelay_store_disk_write_errors_total``                    disk commits that failed with an I/O error
                                                             (ENOSPC, EIO); each starts a back-off
``kvrelay_store_disk_open_failures_total``     reason        times the disk tier could not be opened (or
                                                             started afresh), by errno name: ENOSPC,
                                                             EROFS, EACCES, ENOTDIR, EIO, …, other
``kvrelay_store_disk_available``                             1: the disk tier is in use; 0: unavailable
                                                             or none configured (/health ``disk_tier``)
``kvrelay_prompts_total``                                    prompts reported by `record_prompt`
``kvrelay_prefix_shorter_than_block_total``                  prompts whose shareable prefix < one block
``kvrelay_kv_policy_tail_blocks``                            ``cold-tail``'s ``M`` now; -1: no cap (gauge)
``kvrelay_kv_integrity_checks_total``          where         blocks whose landed bytes were hashed
``kvrelay_kv_integrity_failures_total``        where         blocks that failed their digest (dropped)
=============================================  ============  ===========================================
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge


@dataclass(frozen=True, slots=True)
class StoreMetrics:
    """The metric objects of one store; create with `StoreMetrics.create`."""

    registry: CollectorRegistry
    kv_blocks: Gauge
    kv_bytes: Gauge
    prefix_queries: Counter
    prefix_hits: Counter
    tier_moves: Counter
    tier_evictions: Counter
    store_corrupt: Counter
    dropped_writes: Counter
    disk_write_errors: Counter
    disk_open_failures: Counter
    disk_available: Gauge
    prompts: Counter
    prefix_shorter_than_block: Counter
    tail_blocks: Gauge
    integrity_checks: Counter
    integrity_failures: Counter
    fetch_skipped: Counter

    @classmethod
    def create(cls, registry: CollectorRegistry | None = None) -> StoreMetrics:
        """Register every store metric in ``registry`` (a fresh registry when None).

        Raises:
            ValueError: ``registry`` already holds these names (one store per registry).
        """
        reg = registry if registry is not None else CollectorRegistry()
        return cls(
            registry=reg,
            kv_blocks=Gauge("kvrelay_kv_blocks", "KV blocks per tier and state", ["tier", "state"], registry=reg),
            kv_bytes=Gauge("kvrelay_kv_bytes", "KV bytes per tier and state (blocks x block bytes)",
                           ["tier", "state"], registry=reg),
            prefix_queries=Counter(
                "kvrelay_prefix_cache_queries_total", "Blocks looked up in the prefix cache", registry=reg
            ),
            prefix_hits=Counter(
                "kvrelay_prefix_cache_hits_total", "Blocks found in the prefix cache, by tier", ["tier"],
                registry=reg,
            ),
            tier_moves=Counter(
                "kvrelay_tier_moves_total", "Blocks copied between tiers", ["src", "dst"], registry=reg
            ),
            tier_evictions=Counter(
                "kvrelay_tier_evictions_total", "Blocks dropped from a tier for good", ["tier"], registry=reg
            ),
            store_corrupt=Counter(
                "kvrelay_store_corrupt_total", "Disk values or environments found corrupt", registry=reg
            ),
            dropped_writes=Counter(
                "kvrelay_store_dropped_writes_total", "Disk writes dropped (queue full or no room)", registry=reg
            ),
            disk_write_errors=Counter(
                "kvrelay_store_disk_write_errors_total", "Disk tier commits that failed with an I/O error (disk full, "
                "EIO); each starts a back-off", registry=reg,
            ),
            disk_open_failures=Counter(
                "kvrelay_store_disk_open_failures_total", "Times the disk tier could not be opened or started afresh "
                "(the node serves without it), by errno name", ["reason"], registry=reg,
            ),
            disk_available=Gauge(
                "kvrelay_store_disk_available", "1 while the configured disk tier is in use, 0 while it is "
                "unavailable", registry=reg,
            ),
            prompts=Counter("kvrelay_prompts_total", "Prompts reported to the store", registry=reg),
            prefix_shorter_than_block=Counter(
                "kvrelay_prefix_shorter_than_block_total",
                "Prompts whose shareable prefix is shorter than one block (they cannot hit the cache)",
                registry=reg,
            ),
            tail_blocks=Gauge(
                "kvrelay_kv_policy_tail_blocks",
                "Blocks past a prompt's cached prefix kept hot by the cold-tail policy; -1: no cap", registry=reg,
            ),
            integrity_checks=Counter(
                "kvrelay_kv_integrity_checks_total", "KV blocks whose landed bytes were checked against their "
                "digest, by where they landed (nixl_read, host, disk, recall, verify)", ["where"], registry=reg,
            ),
            integrity_failures=Counter(
                "kvrelay_kv_integrity_failures_total", "KV blocks whose bytes did not match their digest where "
                "they landed (dropped and recomputed, never served)", ["where"], registry=reg,
            ),
            fetch_skipped=Counter(
                "kvrelay_store_fetch_skipped_blocks", "Prefix-hit blocks on a lower tier recomputed instead, since "
                "fetching them was predicted slower (kvstore.fetch_cost)", registry=reg,
            ),
        )
