"""The on-disk record of one block: the LMDB value format of the ``disk`` tier.

::

    offset  size  field
         0     8  magic            b"KVRLYBK\\0"
         8     2  format version   u16 LE (1)
        10     1  checksum algo    u8 (see CHECKSUM_ID_TO_ALGO)
        11     1  (zero)
        12     4  header bytes     u32 LE (128)
        16     8  payload bytes    u64 LE (== BlockSpec.block_bytes)
        24    32  spec fingerprint
        56    32  block key        (== the LMDB key)
        88    16  checksum         over bytes [0, 88) and the payload
       104    24  (zero)
       128     …  payload          the block, spec.block_shape in spec dtype, C order
         …     …  zero padding     so that the value fills whole LMDB pages

LMDB stores a value this large on overflow pages, ``ceil((16 + len) / page_size)`` of them, so a value
of ``pages·page_size − 16`` bytes wastes nothing (`record_bytes`).

Checksums, by measurement on the 2-core machine this was built on (2 MiB payloads, one thread):
LMDB warm read + copy ≈ 7–10 GB/s, ``zlib.crc32`` ≈ 1.7–3.6 GB/s, ``blake2b`` ≈ 0.2–0.8 GB/s — neither
keeps up with the read. ``pagesum`` (the default) sums each 4 KiB page of the payload as 512 u64 words
with numpy (≈ 24 GB/s) and hashes the page sums and any tail with blake2b-128: it catches any change
confined to one 64-bit word of a page (every single-bit flip), zeroed, garbage, swapped, missing or
truncated pages, but not changes that keep every page's 64-bit sum (e.g. two opposite flips of one bit
position in one page, or two words swapped within a page). ``crc32`` and ``blake2b`` stay available;
the algorithm id is in each header, so records written with any known algorithm stay readable.

``xxh3`` (≈ 25 GB/s; what a store with ``kvstore.integrity`` on writes): the first 8 bytes are the
block's digest (`kvstore.digest`: xxh3-64 of the payload seeded by the key), the last 8 an xxh3-64 of
the header. The digest is the one the block carried since it was keyed (`RecordCodec.seal`), so a
block whose bytes changed before it was demoted fails here instead of being laundered into a valid
record; `record_digest` reads it back.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import xxhash
from kvrelay.kvstore.block_spec import BlockSpec

MAGIC = b"KVRLYBK\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 128
LMDB_PAGE_HEADER_BYTES = 16
_HEAD = struct.Struct("<8sHBxIQ32s32s")  # everything the checksum covers in the header: 88 bytes
CHECKSUM_OFFSET = _HEAD.size
FOREIGN_PROBLEM = "written for another BlockSpec fingerprint"  # a record of another model or layout
CHECKSUM_BYTES = 16
SUM_PAGE_BYTES = 4096

Checksum = Callable[[memoryview, memoryview], bytes]  # (header[:88], payload) -> 16 bytes


def _crc32(head: memoryview, payload: memoryview) -> bytes:
    return zlib.crc32(payload, zlib.crc32(head)).to_bytes(4, "little") + bytes(12)


def _blake2b(head: memoryview, payload: memoryview) -> bytes:
    h = hashlib.blake2b(head, digest_size=CHECKSUM_BYTES)
    h.update(payload)
    return h.digest()


def _pagesum(head: memoryview, payload: memoryview) -> bytes:
    num_full = len(payload) // SUM_PAGE_BYTES * SUM_PAGE_BYTES
    h = hashlib.blake2b(head, digest_size=CHECKSUM_BYTES)
    if num_full:
        words = np.frombuffer(payload, dtype="<u8", count=num_full // 8)
        h.update(words.reshape(-1, SUM_PAGE_BYTES // 8).sum(axis=1, dtype=np.uint64).tobytes())
    h.update(payload[num_full:])
    return h.digest()


_KEY_OFFSET = 56  # where the block key starts in the header


def _xxh3_parts(head: memoryview, digest: int) -> bytes:
    return digest.to_bytes(8, "little") + xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")


def _xxh3(head: memoryview, payload: memoryview) -> bytes:
    seed = int.from_bytes(head[_KEY_OFFSET : _KEY_OFFSET + 8], "little")  # == kvstore.digest.seed_of(key)
    return _xxh3_parts(head, xxhash.xxh3_64_intdigest(payload, seed=seed))


CHECKSUM_ID_TO_ALGO: dict[int, tuple[str, Checksum]] = {
    1: ("crc32", _crc32),
    2: ("blake2b", _blake2b),
    3: ("pagesum", _pagesum),
    4: ("xxh3", _xxh3),
}
XXH3_ID = 4
CHECKSUM_NAME_TO_ID: dict[str, int] = {name: i for i, (name, _) in CHECKSUM_ID_TO_ALGO.items()}


def record_bytes(payload_bytes: int, page_bytes: int) -> int:
    """Length of a record holding ``payload_bytes``: header + payload padded to fill whole LMDB pages."""
    pages = -(-(LMDB_PAGE_HEADER_BYTES + HEADER_BYTES + payload_bytes) // page_bytes)
    return pages * page_bytes - LMDB_PAGE_HEADER_BYTES


def disk_bytes_of(value_len: int, page_bytes: int) -> int:
    """Bytes of the LMDB map a value of ``value_len`` bytes occupies (its overflow pages)."""
    return -(-(LMDB_PAGE_HEADER_BYTES + value_len) // page_bytes) * page_bytes


LEAF_BYTES_PER_BLOCK = 128  # a 32-byte key in two sub-databases (blocks, atime): node headers and page slack


def entry_bytes(value_len: int, page_bytes: int) -> int:
    """Map bytes one stored block takes: its value's overflow pages plus its leaf-page nodes."""
    return disk_bytes_of(value_len, page_bytes) + LEAF_BYTES_PER_BLOCK


@dataclass(frozen=True, slots=True)
class RecordCodec:
    """Builds and checks records for one `BlockSpec` and LMDB page size.

    Raises:
        ValueError: an unknown checksum name.
    """

    spec: BlockSpec
    page_bytes: int
    checksum: str = "pagesum"

    def __post_init__(self) -> None:
        if self.checksum not in CHECKSUM_NAME_TO_ID:
            raise ValueError(f"unknown checksum {self.checksum!r}; use one of {sorted(CHECKSUM_NAME_TO_ID)}")

    @property
    def value_bytes(self) -> int:
        return record_bytes(self.spec.block_bytes, self.page_bytes)

    def new_record(self, key: bytes) -> bytearray:
        """A zeroed record with its header filled in except the checksum (see `seal`)."""
        buf = bytearray(self.value_bytes)
        _HEAD.pack_into(
            buf, 0, MAGIC, FORMAT_VERSION, CHECKSUM_NAME_TO_ID[self.checksum], HEADER_BYTES,
            self.spec.block_bytes, self.spec.fingerprint, key,
        )
        return buf

    def payload_view(self, record: bytearray | memoryview) -> memoryview:
        return memoryview(record)[HEADER_BYTES : HEADER_BYTES + self.spec.block_bytes]

    def seal(self, record: bytearray, digest: int | None = None) -> None:
        """Write the checksum of a record whose header and payload are final. Mutates ``record``.

        ``digest``: with the ``xxh3`` algorithm, the block's known digest, written instead of one
        computed from the payload (which is then not read).
        """
        view = memoryview(record)
        if digest is not None and self.checksum == "xxh3":
            view[CHECKSUM_OFFSET : CHECKSUM_OFFSET + CHECKSUM_BYTES] = _xxh3_parts(view[:CHECKSUM_OFFSET], digest)
            return
        algo = CHECKSUM_ID_TO_ALGO[CHECKSUM_NAME_TO_ID[self.checksum]][1]
        view[CHECKSUM_OFFSET : CHECKSUM_OFFSET + CHECKSUM_BYTES] = algo(view[:CHECKSUM_OFFSET], self.payload_view(view))

    @staticmethod
    def record_digest(header: bytearray | memoryview) -> int | None:
        """The block digest an ``xxh3`` record's header carries (None for the other algorithms)."""
        if header[10] != XXH3_ID:
            return None
        return int.from_bytes(header[CHECKSUM_OFFSET : CHECKSUM_OFFSET + 8], "little")

    def problem(self, key: bytes, value: memoryview) -> str | None:
        """Why ``value`` (read under ``key``) is not a valid record of this spec, or None if it is."""
        return self.header_problem(key, value) or self.checksum_problem(value, self.payload_view(value))

    def header_problem(self, key: bytes, value: memoryview, value_len: int | None = None) -> str | None:
        """`problem` without the checksum: magic, version, sizes, fingerprint, key, length. ``value`` may be
        just a copy of the header, with the stored value's length in ``value_len``."""
        value_len = len(value) if value_len is None else value_len
        if value_len < HEADER_BYTES:
            return f"value of {value_len} bytes is shorter than the {HEADER_BYTES}-byte header"
        magic, version, algo_id, header_len, payload_len, fingerprint, stored_key = _HEAD.unpack_from(value, 0)
        if magic != MAGIC:
            return "bad magic"
        if version != FORMAT_VERSION:
            return f"format version {version}, expected {FORMAT_VERSION}"
        if header_len != HEADER_BYTES or payload_len != self.spec.block_bytes:
            return f"header says {header_len}+{payload_len} bytes, expected {HEADER_BYTES}+{self.spec.block_bytes}"
        if fingerprint != self.spec.fingerprint:
            return FOREIGN_PROBLEM
        if stored_key != key:
            return "stored under another key"
        if value_len < HEADER_BYTES + payload_len:
            return f"truncated: {value_len} bytes, need {HEADER_BYTES + payload_len}"
        if algo_id not in CHECKSUM_ID_TO_ALGO:
            return f"unknown checksum algorithm id {algo_id}"
        return None

    def checksum_problem(self, value: memoryview, payload: memoryview) -> str | None:
        """Whether ``payload`` (the record's payload, or a copy of it) matches the checksum in the header of
        ``value``, which `header_problem` has accepted."""
        name, algo = CHECKSUM_ID_TO_ALGO[value[10]]
        want = bytes(value[CHECKSUM_OFFSET : CHECKSUM_OFFSET + CHECKSUM_BYTES])
        if algo(value[:CHECKSUM_OFFSET], payload) != want:
            return f"{name} checksum mismatch"
        return None
