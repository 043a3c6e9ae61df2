"""`BlockTables`: the one place that writes a sequence's block table.

A sequence's ``block_table`` lists the device blocks that hold its KV rows, in order. The scheduler
(admission, growth, copy-on-write, preemption, finish), the engine (``n > 1`` forks) and the
long-context policies (H2O compaction, InfiniGen offload) all change tables, and every change also
moves a block reference in the `BlockPool`. Doing both here, and only here, keeps the invariant that
each entry of a table holds exactly one pool reference. A test checks that no other module assigns to
``block_table`` or mutates it in place.

A table may hold `NULL_BLOCK` entries: blocks of a sliding-window group that fell out of the window and
were given back (`drop`); they hold no reference, and no kernel reads them (every attention backend
starts at the window's first block).

Runs on the engine thread (the pool is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from kvrelay.engine.sequence import Sequence
from kvrelay.kvstore.block_pool import BlockPool

NULL_BLOCK = -1  # a table entry whose block was given back (see module doc)


def held(block_ids: Seq[int]) -> list[int]:
    """The entries of ``block_ids`` that hold a block (not `NULL_BLOCK`)."""
    return [b for b in block_ids if b != NULL_BLOCK]


class BlockTables:
    """Writes block tables and moves the matching pool references.

    Args:
        pool: the device `BlockPool`; its ref counts are its own business, this class only acquires
            and releases them together with table edits.
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool

    def assign(self, seq: Sequence, block_ids: Seq[int]) -> None:
        """Start ``seq``'s table with ``block_ids``, whose references the caller already holds and hands
        over (a prefix-cache hit). The table must be empty."""
        assert not seq.block_table, f"sequence {seq.seq_id} already has blocks"
        seq.block_table = list(block_ids)

    def grow(self, seq: Sequence, n: int, *, required: bool = False) -> bool:
        """Append ``n`` fresh blocks. Returns False (changing nothing) when the pool cannot give them,
        unless ``required``, where the caller has counted free blocks and a shortage is a bug (raises
        from the pool)."""
        if n <= 0:
            return True
        if required:
            seq.block_table.extend(self.pool.allocate(n))
            return True
        new = self.pool.try_allocate(n)
        if new is None:
            return False
        seq.block_table.extend(new)
        return True

    def replace(self, seq: Sequence, start: int, stop: int, new_ids: Seq[int] = ()) -> None:
        """Release the references of ``block_table[start:stop]`` and put ``new_ids`` in their place
        (their references move into the table). ``stop == start`` inserts; empty ``new_ids`` deletes."""
        assert 0 <= start <= stop <= len(seq.block_table), (start, stop, len(seq.block_table))
        removed = held(seq.block_table[start:stop])
        seq.block_table[start:stop] = list(new_ids)
        if removed:
            self.pool.release(removed)

    def drop(self, seq: Sequence, index: int) -> None:
        """Give back the block at ``block_table[index]`` (a sliding group's block out of the window) and
        leave `NULL_BLOCK` in its place; a `NULL_BLOCK` entry stays as it is."""
        block = seq.block_table[index]
        if block != NULL_BLOCK:
            seq.block_table[index] = NULL_BLOCK
            self.pool.release([block])

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the blocks of ``parent`` (shared: one more reference each)."""
        assert not child.block_table, f"sequence {child.seq_id} already has blocks"
        child.block_table = list(parent.block_table)
        self.pool.acquire(held(child.block_table))

    def free(self, seq: Sequence) -> None:
        """Release every block of ``seq``'s table and empty it."""
        blocks = held(seq.block_table)
        if blocks:
            self.pool.release(blocks)
        seq.block_table = []
