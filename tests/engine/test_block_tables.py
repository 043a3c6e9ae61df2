"""`BlockTables` is the one writer of block tables: its edits keep one pool reference per table entry,
and no other module assigns to or mutates ``block_table``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from kvrelay.engine.block_tables import BlockTables
from kvrelay.engine.sequence import Sequence
from kvrelay.kvstore.block_pool import BlockPool, NoFreeBlocksError
from kvrelay.model.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("decode", "deploy", "engine", "kernels", "kvstore", "model", "node", "prefill", "router", "transfer")
MUTATORS = {"append", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "__setitem__", "__delitem__"}


def _seq(seq_id: int) -> Sequence:
    return Sequence(seq_id=seq_id, request_id=f"r{seq_id}", index=0, arrival=seq_id, token_ids=[1, 2, 3],
                    num_prompt_tokens=3, params=SamplingParams(), salt=b"", seed=0)


def test_edits_move_pool_references_with_table_entries() -> None:
    pool = BlockPool(6)
    tables = BlockTables(pool)
    a, b = _seq(0), _seq(1)
    assert tables.grow(a, 3)
    assert a.block_table == [0, 1, 2]
    tables.fork(a, b)
    assert b.block_table == [0, 1, 2] and [pool.ref_count(x) for x in range(3)] == [2, 2, 2]
    new = pool.allocate(1)
    tables.replace(b, 2, 3, new)  # copy on write of b's tail
    assert b.block_table == [0, 1, 3] and pool.ref_count(2) == 1 and pool.ref_count(3) == 1
    tables.replace(a, 1, 3)  # delete
    assert a.block_table == [0] and pool.ref_count(1) == 1 and pool.ref_count(2) == 0
    tables.replace(a, 1, 1, pool.allocate(2))  # insert
    assert a.block_table == [0, 4, 5]
    assert not tables.grow(a, 2)  # only block 2 is free: nothing changes
    assert a.block_table == [0, 4, 5] and pool.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        tables.grow(a, 2, required=True)
    tables.free(a)
    tables.free(b)
    assert a.block_table == [] and b.block_table == [] and pool.num_free_blocks == 6
    pool.check_integrity()


def _writes_block_table(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, (ast.Assign, ast.Delete)):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr == "block_table":
                lines.append(node.lineno)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS
                and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "block_table"):
            lines.append(node.lineno)
    return lines


def test_only_block_tables_writes_block_tables() -> None:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            lines = _writes_block_table(ast.parse(path.read_text()))
            if lines:
                found[str(path.relative_to(ROOT))] = lines
    assert set(found) == {"engine/block_tables.py"}, found


def test_the_write_finder_sees_every_kind_of_write() -> None:
    src = "s.block_table = []\ns.block_table[0] = 1\ndel s.block_table[1:]\ns.block_table.extend(x)\n" \
          "s.block_table += [1]\nx = s.block_table[0]\nlen(s.block_table)\n"
    assert sorted(_writes_block_table(ast.parse(src))) == [1, 2, 3, 4, 5]
