import pytest
import torch
from kvrelay.kvstore.block_record import (
    CHECKSUM_NAME_TO_ID,
    HEADER_BYTES,
    RecordCodec,
    disk_bytes_of,
    record_bytes,
)
from kvrelay.kvstore.block_spec import BlockSpec

from tests.kvstore.store_helpers import SPEC, block_value, chain


def sealed(codec: RecordCodec, key: bytes, i: int) -> bytearray:
    record = codec.new_record(key)
    torch.frombuffer(record, dtype=torch.uint8, count=SPEC.block_bytes, offset=HEADER_BYTES).copy_(
        block_value(i).reshape(-1).view(torch.uint8)
    )
    codec.seal(record)
    return record


def test_record_fills_whole_lmdb_pages():
    assert record_bytes(2048, 4096) == 4096 - 16
    assert record_bytes(4096 - 16 - 128, 4096) == 4096 - 16
    assert record_bytes(4096 - 16 - 127, 4096) == 2 * 4096 - 16
    mib2 = 2 << 20
    assert disk_bytes_of(record_bytes(mib2, 4096), 4096) == mib2 + 4096  # one page of header overhead


@pytest.mark.parametrize("checksum", sorted(CHECKSUM_NAME_TO_ID))
def test_every_corruption_is_named(checksum):
    codec = RecordCodec(SPEC, 4096, checksum)
    key = chain(1)[0]
    record = sealed(codec, key, 3)
    assert codec.problem(key, memoryview(record)) is None
    flipped = bytearray(record)
    flipped[HEADER_BYTES + 1000] ^= 0x10
    assert "checksum mismatch" in codec.problem(key, memoryview(flipped))
    assert "truncated" in codec.problem(key, memoryview(record)[: HEADER_BYTES + 100])
    assert "shorter than" in codec.problem(key, memoryview(record)[:50])
    assert codec.problem(chain(2)[1], memoryview(record)) == "stored under another key"
    other = RecordCodec(BlockSpec(**{**_fields(SPEC), "model_fingerprint": "other"}), 4096, checksum)
    assert other.problem(key, memoryview(record)) == "written for another BlockSpec fingerprint"
    bad_magic = bytearray(record)
    bad_magic[0] ^= 1
    assert codec.problem(key, memoryview(bad_magic)) == "bad magic"
    padding_only = bytearray(record)
    padding_only[-1] ^= 0xFF  # the zero padding after the payload is not KV
    assert codec.problem(key, memoryview(padding_only)) is None


def test_records_of_any_known_checksum_stay_readable():
    key = chain(1)[0]
    record = sealed(RecordCodec(SPEC, 4096, "crc32"), key, 1)
    assert RecordCodec(SPEC, 4096, "pagesum").problem(key, memoryview(record)) is None
    with pytest.raises(ValueError, match="unknown checksum"):
        RecordCodec(SPEC, 4096, "md5")


def test_pagesum_catches_swapped_pages_and_a_change_in_the_tail():
    big = BlockSpec(num_layers=8, num_kv_heads=2, head_dim=16, block_size_tokens=4)  # 8 KiB: two pages
    codec = RecordCodec(big, 4096, "pagesum")
    key = chain(1)[0]
    record = codec.new_record(key)
    for i in range(big.block_bytes // 4096):
        record[HEADER_BYTES + i * 4096 : HEADER_BYTES + (i + 1) * 4096] = bytes([i + 1]) * 4096
    codec.seal(record)
    assert codec.problem(key, memoryview(record)) is None
    swapped = bytearray(record)
    a, b = HEADER_BYTES, HEADER_BYTES + 4096
    swapped[a : a + 4096], swapped[b : b + 4096] = record[b : b + 4096], record[a : a + 4096]
    assert "pagesum checksum mismatch" in codec.problem(key, memoryview(swapped))
    odd = BlockSpec(num_layers=1, num_kv_heads=1, head_dim=3, block_size_tokens=700)  # 16800 bytes
    codec = RecordCodec(odd, 4096, "pagesum")
    record = codec.new_record(key)
    record[HEADER_BYTES + 16700] = 7  # in the 416-byte tail after four whole pages
    codec.seal(record)
    assert codec.problem(key, memoryview(record)) is None
    record[HEADER_BYTES + 16700] = 8
    assert "pagesum checksum mismatch" in codec.problem(key, memoryview(record))


def _fields(spec: BlockSpec) -> dict:
    return {f: getattr(spec, f) for f in spec.__dataclass_fields__}
