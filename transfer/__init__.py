"""kvrelay: transfer — KV blocks between processes over NIXL (the only package that imports NIXL).

    config.py        TransferConfig
    nixl_agent.py    KvAgent: one NIXL agent per node, tier pools registered once, READs, loopback copies
    metadata.py      AgentMeta / TierRegion: what GET /kv/meta publishes; check_compatible
    handle.py        KvHandle: what an owner gives a reader
    wire.py          msgpack encode/decode with limits (WireError); never pickle
    lease.py         LeaseTable (owner): time-bounded pins; TierBlock
    owner.py         KvOwner: offer handles, unpin on notification or expiry
    server.py        add_transfer_routes / make_transfer_app: /kv/meta, /kv/lease/renew
    peer_cache.py    PeerCache (reader): handshake per owner, restarts, lease renewal over HTTP
    lease_keeper.py  LeaseKeeper (reader): renew while reading, confirm the lease covered the READ
    puller.py        Puller.pull(handle, deadline_s) -> PullResult; quarantine of abandoned READs
    errors.py        TransferError (reason), PeerMismatchError
    pool_call.py     PoolCall: where pool mutations run
    bounded_write.py write_within: an HTTP answer's writes bounded against a reader that stopped reading
"""
