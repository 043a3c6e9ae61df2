import pytest
import torch
from kvrelay.kvstore.block_key import BlockKey
from kvrelay.kvstore.host_tier import HostTier

from tests.kvstore.store_helpers import SPEC, block_value, chain


def test_put_get_and_lru_eviction_order_with_hook_before_overwrite():
    evicted: list[tuple[int, BlockKey, float]] = []
    host: HostTier

    def on_evict(slot: int, key: BlockKey) -> None:
        evicted.append((slot, key, float(host.pool[slot].flatten()[0])))  # bytes still intact

    host = HostTier(SPEC, 3, on_evict=on_evict)
    keys = chain(5)
    for i in range(3):
        assert host.put(keys[i], block_value(i))
    assert host.keys_lru_first() == keys[:3]
    dst = torch.empty(SPEC.block_shape)
    assert host.get_into(keys[0], dst) and torch.equal(dst, block_value(0))  # 0 becomes MRU
    assert host.put(keys[1], block_value(99))  # already held: refresh only, nothing copied
    assert host.keys_lru_first() == [keys[2], keys[0], keys[1]]
    host.put(keys[3], block_value(3))
    host.put(keys[4], block_value(4))
    assert evicted == [(2, keys[2], 2.0), (0, keys[0], 0.0)]
    assert host.keys_lru_first() == [keys[1], keys[3], keys[4]]
    assert host.get_into(keys[1], dst) and torch.equal(dst, block_value(1))
    assert not host.get_into(keys[0], dst)
    assert host.match_prefix(keys[2:]) == 0 and host.match_prefix([keys[3], keys[4], keys[0]]) == 2
    assert host.discard(keys[3]) and not host.discard(keys[3])
    assert host.stats().num_blocks == 2 and host.stats().capacity_blocks == 3
    assert host.pinned == torch.cuda.is_available()
    host.check_integrity()


def test_rejects_wrong_shape_and_dtype():
    host = HostTier(SPEC, 1)
    with pytest.raises(ValueError, match="host tier block must be"):
        host.put(chain(1)[0], torch.zeros(3))
    with pytest.raises(ValueError, match="host tier block must be"):
        host.put(chain(1)[0], torch.zeros(SPEC.block_shape, dtype=torch.float16))
    with pytest.raises(ValueError, match="positive number of blocks"):
        HostTier(SPEC, 0)
    host.check_integrity()


def test_blocks_as_byte_rows_copy_the_same_bytes():
    host = HostTier(SPEC, 2)
    key = chain(1)[0]
    src = block_value(4)
    assert host.put(key, src.view(-1).view(torch.uint8).numpy())
    out = torch.empty(SPEC.block_shape)
    assert host.get_into(key, out.view(-1).view(torch.uint8).numpy()) and torch.equal(out, src)
    assert host.block(host.slot_of(key)).nbytes == SPEC.block_bytes
    with pytest.raises(ValueError, match=f"must be {SPEC.block_bytes} bytes"):
        host.put(chain(2)[1], src.view(-1).view(torch.uint8).numpy()[:100])
    host.check_integrity()
