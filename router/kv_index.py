"""`KvIndex`: which node holds which block key, built from the nodes' KV events."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvrelay.kvstore.block_key import BlockKey


class KvIndex:
    """Exact key → nodes index. Owned by the router's event loop (no locking)."""

    def __init__(self) -> None:
        self._key_to_nodes: dict[BlockKey, set[str]] = {}
        self._node_to_keys: dict[str, set[BlockKey]] = {}
        self.node_to_last_seq: dict[str, int] = {}

    def apply(self, node: str, stored: Iterable[BlockKey], removed: Iterable[BlockKey], last_seq: int) -> None:
        keys = self._node_to_keys.setdefault(node, set())
        for key in stored:
            self._key_to_nodes.setdefault(key, set()).add(node)
            keys.add(key)
        for key in removed:
            nodes = self._key_to_nodes.get(key)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._key_to_nodes[key]
            keys.discard(key)
        self.node_to_last_seq[node] = last_seq

    def replace(self, node: str, snapshot: Iterable[BlockKey], last_seq: int) -> None:
        """Forget what ``node`` held and take ``snapshot`` instead (a late join, a gap, a restart)."""
        self.drop_node(node)
        self.apply(node, snapshot, (), last_seq)

    def drop_node(self, node: str) -> None:
        for key in self._node_to_keys.pop(node, set()):
            nodes = self._key_to_nodes.get(key)
            if nodes is not None:
                nodes.discard(node)
                if not nodes:
                    del self._key_to_nodes[key]
        self.node_to_last_seq.pop(node, None)

    def prefix_blocks(self, keys: Sequence[BlockKey], nodes: Iterable[str]) -> dict[str, int]:
        """For each of ``nodes``, how many leading ``keys`` it holds."""
        out = {n: 0 for n in nodes}
        alive = set(out)
        for i, key in enumerate(keys):
            holders = self._key_to_nodes.get(key)
            if not holders:
                break
            alive &= holders
            if not alive:
                break
            for n in alive:
                out[n] = i + 1
        return out

    def num_keys(self, node: str) -> int:
        return len(self._node_to_keys.get(node, ()))
