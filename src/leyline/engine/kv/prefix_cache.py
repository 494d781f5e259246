"""Prefix cache shared across sessions: a token trie of per-layer KV at block granularity.

A node is one block of ``block_size`` tokens, its payload that block's KV (``kv_blocks``:
any layout); it was computed attending to exactly the tokens on its path, so a prompt
reuses the longest block-aligned prefix it shares. docs/prefix_cache.md has the design.
"""

from __future__ import annotations

import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from leyline.engine.kv.block_trie import BlockInfo, BlockTrie, TrieNode
from leyline.engine.kv.kv_blocks import (
    KVCache,
    KVLayout,
    KVLayoutError,
    PrefixCacheError,
    concat_blocks,
    kv_layout,
    kv_nbytes,
    kv_seq_len,
    slice_block,
)

__all__ = [
    "BlockInfo",
    "EvictResult",
    "InsertResult",
    "InvalidConfigError",
    "KVCache",
    "KVLayoutError",
    "LockHandle",
    "MatchResult",
    "PrefixCache",
    "PrefixCacheError",
    "PrefixCacheStats",
    "PurgeResult",
    "StaleHandleError",
    "TokenError",
]


class InvalidConfigError(PrefixCacheError):
    """An argument no cache state could make valid (negative budget, block size < 1)."""


class TokenError(PrefixCacheError):
    """Tokens that are not integers, or do not line up with the KV or a position."""


class StaleHandleError(PrefixCacheError):
    """A handle unlocked twice, or one this cache never issued."""


@dataclass(frozen=True, slots=True)
class LockHandle:
    """Keeps the first ``tokens`` tokens of a sequence resident until unlocked."""

    id: int
    tokens: int


class EvictResult(NamedTuple):
    blocks: int
    bytes: int


class MatchResult(NamedTuple):
    matched_tokens: int
    kv: KVCache | None
    handle: LockHandle | None


class InsertResult(NamedTuple):
    cached_tokens: int
    inserted_tokens: int
    stored_tokens: int
    evicted: EvictResult
    handle: LockHandle | None


class PurgeResult(NamedTuple):
    dropped: tuple[BlockInfo, ...]
    kept: tuple[BlockInfo, ...]
    """Blocks derived from the forgotten span that a handle still references."""

    @property
    def dropped_bytes(self) -> int:
        return sum(b.nbytes for b in self.dropped)


class PrefixCacheStats(NamedTuple):
    blocks: int
    bytes_used: int
    bytes_locked: int
    budget_bytes: int
    hits: int
    misses: int
    hit_tokens: int
    evicted_blocks: int
    purged_blocks: int


def _as_tokens(tokens: Sequence[int]) -> tuple[int, ...]:
    try:
        # operator.index accepts ints, numpy ints and 0-d integer tensors, but not floats.
        return tuple(operator.index(t) for t in tokens)
    except TypeError as exc:
        raise TokenError(f"tokens must be integers: {exc}") from None


class PrefixCache:
    """Block-granular token trie of per-layer KV with LRU eviction; every method is
    thread-safe (one lock guards the trie).

    A node's children are keyed by the tokens of the next block, so a node stands for the
    whole block-aligned prefix on its path; a node covering positions ``[start, end)`` was
    computed attending to the path's tokens ``[0, end)``, and nothing else. Salts partition
    the cache: a block stored under one salt is never matched, purged or counted as reused
    under another (the server salts by tenant and per-request ``cache_salt``, so no KV and
    no reuse count crosses them). Budget and LRU span all salts.

    Raises ``InvalidConfigError`` for a negative budget, ``block_size < 1`` or a non-int
    ``seq_dim``. ``budget_bytes=0`` disables caching. The first insert fixes the KV layout
    (layers, tensors per layer, their shapes without the sequence dim, dtype, device).
    """

    def __init__(self, budget_bytes: int, *, block_size: int = 16, seq_dim: int = -2) -> None:
        for name, value, low in (("budget_bytes", budget_bytes, 0), ("block_size", block_size, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise InvalidConfigError(f"{name} must be an int >= {low}, got {value!r}")
        if not isinstance(seq_dim, int) or isinstance(seq_dim, bool):
            raise InvalidConfigError(f"seq_dim must be an int, got {seq_dim!r}")
        self.budget_bytes = budget_bytes
        self.block_size = block_size
        self.seq_dim = seq_dim
        self._lock = threading.Lock()
        self._trie = BlockTrie(block_size)
        self._layout: KVLayout | None = None
        self._handles: dict[int, TrieNode] = {}
        self._next_handle = 1
        self._hits = self._misses = self._hit_tokens = self._evicted = self._purged = 0

    def match(self, tokens: Sequence[int], *, lock: bool = False, salt: str = "") -> MatchResult:
        """Longest cached block-aligned prefix of ``tokens``. Returns ``matched_tokens`` (a multiple
        of ``block_size``), ``kv`` (a fresh concatenation, safe to edit in place; ``None`` when
        nothing matched) and, if ``lock``, a ``handle`` that keeps the matched blocks resident
        until ``unlock``. Counts a hit or a miss and refreshes the blocks' LRU age.
        """
        toks = _as_tokens(tokens)
        with self._lock:
            path = self._trie.walk(toks, salt)
            self._trie.touch(path)
            n = len(path) * self.block_size
            if n:
                self._hits += 1
                self._hit_tokens += n
            else:
                self._misses += 1
            # Copy under the lock: once released, eviction may drop these blocks.
            kv = concat_blocks([node.kv for node in path], self.seq_dim) if path else None
            # A miss locks nothing (roots are never counted): any root will do, and looking
            # a salt up must not create one.
            handle = self._new_handle(path[-1] if path else self._trie.root) if lock else None
        return MatchResult(n, kv, handle)

    def insert(
        self,
        tokens: Sequence[int],
        kv: Sequence[Sequence[torch.Tensor]],
        *,
        lock: bool = False,
        salt: str = "",
    ) -> InsertResult:
        """Caches the full blocks of ``tokens`` (a trailing partial block is ignored); ``kv`` must
        have exactly ``len(tokens)`` entries along ``seq_dim``. Blocks already cached are kept,
        new ones are copied in. When a block would exceed the budget, least recently used
        unreferenced leaves are evicted first; when even that cannot make room, insertion stops
        there (best effort, not an error). Returns ``cached_tokens`` (present before),
        ``inserted_tokens``, ``stored_tokens`` (the sequence's cached prefix now), ``evicted``
        and, if ``lock``, a handle on the stored prefix. Raises ``KVLayoutError`` (layer count,
        tensors per layer, shape, dtype or device differ from the cache's layout) and
        ``TokenError`` (tensor length != ``len(tokens)``, non-integer tokens).
        """
        toks = _as_tokens(tokens)
        trie, bs = self._trie, self.block_size
        with self._lock:
            self._check_kv(toks, kv)
            path = trie.walk(toks, salt)
            trie.touch(path)
            node = path[-1] if path else trie.root_of(salt)
            # Hold the path while inserting, so eviction cannot cut off what we attach to.
            trie.lock(node)
            freed_blocks = freed_bytes = 0
            for b in range(len(path), len(toks) // bs):
                block = slice_block(kv, b * bs, bs, self.seq_dim)
                size = kv_nbytes(block)
                if trie.locked_bytes + size > self.budget_bytes:
                    break  # evicting every unreferenced block would still not make room
                if trie.bytes + size > self.budget_bytes:
                    blocks, freed = trie.evict(trie.bytes + size - self.budget_bytes)
                    freed_blocks, freed_bytes = freed_blocks + blocks, freed_bytes + freed
                node = trie.add_child(node, toks[b * bs : (b + 1) * bs], block, size)
                trie.lock(node, ancestors=False)
            trie.unlock(node)
            trie.drop_if_empty_root(node)  # nothing fitted: no root kept for the salt
            self._evicted += freed_blocks
            handle = self._new_handle(node) if lock else None
        cached = len(path) * bs
        return InsertResult(
            cached, node.end - cached, node.end, EvictResult(freed_blocks, freed_bytes), handle
        )

    def unlock(self, handle: LockHandle) -> None:
        """Releases a handle from ``match`` or ``insert``. Raises ``StaleHandleError`` if the
        handle was already released (or belongs to another cache).
        """
        with self._lock:
            self._release(handle)

    def evict(self, nbytes: int) -> EvictResult:
        """Frees at least ``nbytes`` (if possible) by dropping unreferenced leaves in LRU order."""
        if nbytes < 0:
            raise InvalidConfigError(f"nbytes must be >= 0, got {nbytes}")
        with self._lock:
            blocks, freed = self._trie.evict(nbytes)
            self._evicted += blocks
        return EvictResult(blocks, freed)

    def purge(
        self,
        tokens: Sequence[int],
        start: int,
        *,
        release: LockHandle | None = None,
        salt: str = "",
    ) -> PurgeResult:
        """FORGET support. Drops every cached block that attended to ``tokens[start]`` in the
        context ``tokens[:start]``: every node whose path agrees with ``tokens[: start + 1]``.
        That is the sequence's block containing ``start`` plus its sibling blocks that agree
        with the sequence up to and including position ``start``, and all their descendants.
        Blocks ending at or before ``start`` and siblings that differ within
        ``[block_start, start]`` hold nothing from the forgotten span and stay. A block that a
        handle references (another session's hold) cannot be freed yet: it is detached and
        doomed (``kept`` lists those): no lookup finds it again, and it is freed at its last
        unlock, so it is not reused after its holders let go (a deleted session's blocks too).
        A holder that later publishes its own sequence again inserts fresh blocks: its content
        is its own. Pass the caller's own handle as ``release`` to release it atomically
        first. Afterwards no block derived from the forgotten span can be matched, and
        none comes back except by a new ``insert``. Needs only ``tokens[: start + 1]``; raises
        ``TokenError`` unless ``0 <= start < len(tokens)``.
        """
        toks = _as_tokens(tokens)
        if not 0 <= start < len(toks):
            raise TokenError(f"start must be in [0, {len(toks)}), got {start}")
        with self._lock:
            if release is not None:
                self._release(release)
            dropped, kept = self._trie.purge(toks, start, salt)
            self._purged += len(dropped)
        return PurgeResult(tuple(dropped), tuple(kept))

    def stats(self) -> PrefixCacheStats:
        """Blocks, bytes used and locked, budget, hits, misses, hit tokens, evicted and purged
        blocks."""
        with self._lock:
            t = self._trie
            return PrefixCacheStats(
                t.blocks,
                t.bytes,
                t.locked_bytes,
                self.budget_bytes,
                self._hits,
                self._misses,
                self._hit_tokens,
                self._evicted,
                self._purged,
            )

    # Internals: the caller holds self._lock.

    def _check_kv(self, toks: tuple[int, ...], kv: Sequence[Sequence[torch.Tensor]]) -> None:
        layout = kv_layout(kv, self.seq_dim)
        want = self._layout
        if want is not None and layout != want:
            if len(layout) != len(want):
                raise KVLayoutError(f"expected KV for {len(want)} layers, got {len(layout)}")
            for i, (got_l, want_l) in enumerate(zip(layout, want, strict=True)):
                if got_l != want_l:
                    raise KVLayoutError(f"layer {i}: expected tensors {want_l}, got {got_l}")
        n = kv_seq_len(kv, self.seq_dim)
        if n != len(toks):
            raise TokenError(f"KV holds {n} positions along seq_dim but got {len(toks)} tokens")
        if want is None:
            self._layout = layout

    def _new_handle(self, node: TrieNode) -> LockHandle:
        self._trie.lock(node)
        handle = LockHandle(self._next_handle, node.end)
        self._next_handle += 1
        self._handles[handle.id] = node
        return handle

    def _release(self, handle: LockHandle) -> None:
        node = self._handles.pop(handle.id, None)
        if node is None:
            raise StaleHandleError(f"handle {handle.id} is not held (already unlocked?)")
        self._trie.unlock(node)
