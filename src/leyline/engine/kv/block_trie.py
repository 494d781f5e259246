"""The token trie behind ``PrefixCache``: one node per block, byte and reference counts.

Not thread-safe on its own: ``PrefixCache`` holds its lock around every call. Iterative
throughout (no recursion): a 128k-token sequence is a path of 8k nodes.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from leyline.engine.kv.kv_blocks import KVCache


class BlockInfo(NamedTuple):
    """One cached block: positions ``[start, end)`` of the sequence on its trie path."""

    start: int
    end: int
    refcount: int
    nbytes: int


@dataclass(eq=False, slots=True)
class TrieNode:
    """One block. Its KV attended to exactly the tokens on its path, positions [0, end)."""

    key: tuple[int, ...]
    kv: KVCache
    parent: TrieNode | None
    start: int
    nbytes: int
    id: int
    last_access: int = 0
    refcount: int = 0
    children: dict[tuple[int, ...], TrieNode] = field(default_factory=dict)
    doomed: bool = False
    """Purged while referenced: detached (never matched again), freed at its last unlock."""

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def info(self) -> BlockInfo:
        return BlockInfo(self.start, self.end, self.refcount, self.nbytes)


class BlockTrie:
    """Block trie partitioned by salt: one root per salt, so two salts never share a block
    (tenants, per-request ``cache_salt``). Budget and LRU span every partition.

    Invariants (the tests check them after random operation sequences):

    - ``bytes`` is the sum of ``nbytes`` over all nodes, ``blocks`` their number;
    - a node's ``refcount`` counts the locks on it or on any descendant (a lock covers the
      whole path from the root), so an unreferenced node has only unreferenced descendants;
    - ``locked_bytes`` is the sum of ``nbytes`` over nodes with ``refcount > 0``, so
      ``bytes - locked_bytes`` is exactly what eviction can free.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._roots: dict[str, TrieNode] = {}
        self.blocks = self.bytes = self.locked_bytes = 0
        self._ids = itertools.count(1)
        self._clock = 0
        self.root = self.root_of("")

    def root_of(self, salt: str) -> TrieNode:
        root = self._roots.get(salt)
        if root is None:
            root = TrieNode(key=(), kv=(), parent=None, start=0, nbytes=0, id=next(self._ids))
            self._roots[salt] = root
        return root

    def walk(self, toks: tuple[int, ...], salt: str = "") -> list[TrieNode]:
        """Cached nodes along the full blocks of ``toks``, root excluded, up to the first miss."""
        node = self._roots.get(salt)  # a lookup creates no root: clients choose salts
        if node is None:
            return []
        bs, path = self.block_size, []
        for b in range(len(toks) // bs):
            child = node.children.get(toks[b * bs : (b + 1) * bs])
            if child is None:
                break
            path.append(child)
            node = child
        return path

    def touch(self, path: list[TrieNode]) -> int:
        """Marks ``path`` as used now; returns the new clock (LRU age, not wall time)."""
        self._clock += 1
        for node in path:
            node.last_access = self._clock
        return self._clock

    def add_child(
        self, parent: TrieNode, key: tuple[int, ...], kv: KVCache, nbytes: int
    ) -> TrieNode:
        child = TrieNode(
            key=key,
            kv=kv,
            parent=parent,
            start=parent.end,
            nbytes=nbytes,
            id=next(self._ids),
            last_access=self._clock,
        )
        parent.children[key] = child
        self.blocks += 1
        self.bytes += nbytes
        return child

    def lock(self, node: TrieNode, *, ancestors: bool = True) -> None:
        cur: TrieNode | None = node
        while cur is not None and cur.parent is not None:  # roots are never counted
            if cur.refcount == 0:
                self.locked_bytes += cur.nbytes
            cur.refcount += 1
            cur = cur.parent if ancestors else None

    def unlock(self, node: TrieNode) -> None:
        cur: TrieNode | None = node
        while cur is not None and cur.parent is not None:
            cur.refcount -= 1
            if cur.refcount == 0:
                self.locked_bytes -= cur.nbytes
                if cur.doomed:  # detached by a purge; its last holder is gone
                    self.blocks -= 1
                    self.bytes -= cur.nbytes
            cur = cur.parent

    def remove(self, node: TrieNode) -> None:
        assert node.parent is not None and not node.children and node.refcount == 0
        del node.parent.children[node.key]
        self.blocks -= 1
        self.bytes -= node.nbytes
        self.drop_if_empty_root(node.parent)

    def drop_if_empty_root(self, node: TrieNode) -> None:
        """A salt's root goes with its last block (the public one stays), so the roots are
        bounded by the salts that hold KV, not by every salt ever sent."""
        if node.parent is None and not node.children and node is not self.root:
            salt = next((k for k, root in self._roots.items() if root is node), None)
            if salt is not None:
                del self._roots[salt]

    @property
    def salts(self) -> int:
        """How many partitions hold a root (the public one included)."""
        return len(self._roots)

    def evict(self, need: int) -> tuple[int, int]:
        """Drops unreferenced leaves, least recently used first, until ``need`` bytes are
        freed or none is left. Returns (blocks, bytes) freed."""
        heap: list[tuple[int, int, TrieNode]] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node.refcount == 0:
                heap.append((node.last_access, node.id, node))
        heapq.heapify(heap)
        blocks = freed = 0
        while freed < need and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            self.remove(node)
            blocks, freed = blocks + 1, freed + node.nbytes
            # A parent whose last child went is now a leaf, and as old as that child or older.
            if (
                parent is not None
                and parent.parent is not None
                and not parent.children
                and parent.refcount == 0
            ):
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return blocks, freed

    def purge(
        self, toks: tuple[int, ...], start: int, salt: str = ""
    ) -> tuple[list[BlockInfo], list[BlockInfo]]:
        """Drops every node of ``salt`` whose path agrees with ``toks[: start + 1]``.

        Unreferenced nodes go now. Referenced ones (another session holds them) are detached
        and doomed: no lookup finds them again, and each is freed at its last unlock, so
        nothing derived from ``toks[start]`` is reused by anyone once its holders let go.
        Returns (dropped now, doomed), children before parents."""
        first = start // self.block_size * self.block_size
        path = self.walk(toks[:first], salt)
        if len(path) * self.block_size < first:
            return [], []  # a block before `start` is not cached, so nothing after it is
        parent = path[-1] if path else self._roots.get(salt)
        if parent is None:
            return [], []  # the salt holds nothing
        head = toks[first : start + 1]
        order: list[TrieNode] = []  # preorder; reversed, every child precedes its parent
        stack = [c for key, c in parent.children.items() if key[: len(head)] == head]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        dropped: list[BlockInfo] = []
        kept: list[BlockInfo] = []
        for node in reversed(order):
            if node.refcount:
                kept.append(node.info())
                node.doomed = True
                assert node.parent is not None
                node.parent.children.pop(node.key, None)
                self.drop_if_empty_root(node.parent)
            else:
                dropped.append(node.info())
                self.remove(node)
        return dropped, kept
