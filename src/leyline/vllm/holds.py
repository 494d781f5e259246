"""Skill holds on the engine core's side: blocks kept out of eviction by a reference of
their own in vLLM's ``BlockPool``.

A skill's KV is vLLM's own prefill of ``anchor + block``. When that request finishes, the
scheduler side takes one reference (``BlockPool.touch``, as a prefix hit does) on each of
its blocks covering those rows, the partial last one included: a block whose reference
count is above zero is never in the free queue, so vLLM neither evicts nor reuses it, and a
purge that drops its hash (``evict_blocks``) leaves its data alone. So the blocks are
named by id here, never looked up by hash again. Releasing the hold gives the reference
back (``free_blocks``): the blocks are then ordinary cache, evicted LRU.

At most a quarter of the pool is held (``HELD_SHARE``, as SGLang's plugin holds a quarter
of its pool); past that a hold releases the holds it was told are idle, least recently used
first, or is refused, changing nothing. No vLLM import: the pool is passed in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from leyline.vllm.link import HoldOrder

HELD_SHARE = 4
"""Holds may keep at most ``num_gpu_blocks // HELD_SHARE`` blocks."""


@dataclass(frozen=True, slots=True)
class Held:
    blocks: tuple[Any, ...]
    """The ``KVCacheBlock``s it references, in order: row ``r`` is in ``blocks[r // size]``."""
    rows: int


@dataclass(frozen=True, slots=True)
class HoldResult:
    held: int = 0
    """Rows now held (0: refused)."""
    released: tuple[str, ...] = ()
    error: str | None = None
    """An error code when refused (``limit_exceeded``)."""
    message: str = ""


class Holds:
    """Holds by key over one ``BlockPool``."""

    def __init__(self, pool: Any, block_size: int) -> None:
        self.pool = pool
        self.block_size = block_size
        self._held: dict[str, Held] = {}

    @property
    def capacity(self) -> int:
        return int(self.pool.num_gpu_blocks) // HELD_SHARE

    def held_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._held.values())

    def get(self, key: str) -> Held | None:
        return self._held.get(key)

    def take(self, order: HoldOrder, block_ids: Sequence[int]) -> HoldResult:
        """Hold the blocks ``block_ids`` (a finished request's, in order) that cover the
        order's rows; release what makes room, or refuse with nothing changed."""
        need = -(-order.rows // self.block_size)
        if len(block_ids) < need:
            return HoldResult(
                error="splice_refused",
                message=f"the prefill computed {len(block_ids)} blocks, not {need}",
            )
        replaced = self._held.get(order.replaces) if order.replaces else None
        used = self.held_blocks() - (len(replaced.blocks) if replaced else 0)
        if order.key in self._held and order.key != order.replaces:
            used -= len(self._held[order.key].blocks)
        released: list[str] = []
        for key in order.evictable:
            if used + need <= self.capacity:
                break
            if key in self._held and key not in (order.key, order.replaces):
                released.append(key)
                used -= len(self._held[key].blocks)
        if used + need > self.capacity:
            return HoldResult(
                error="limit_exceeded",
                message=f"skills may hold {self.capacity} of this server's "
                f"{self.pool.num_gpu_blocks} KV blocks; this one needs {need} and {used} "
                "are held by skills in use (or past what releasing idle ones frees)",
            )
        blocks = tuple(self.pool.blocks[b] for b in block_ids[:need])
        self.pool.touch(blocks)  # taken before any release: a shared block stays held
        for gone in (*released, order.key, order.replaces):
            if gone is not None:
                self.release(gone)
        self._held[order.key] = Held(blocks, order.rows)
        return HoldResult(held=order.rows, released=tuple(released))

    def release(self, key: str) -> bool:
        """Give the hold's references back (its blocks are then ordinary cache)."""
        held = self._held.pop(key, None)
        if held is None:
            return False
        self.pool.free_blocks(reversed(held.blocks))  # as vLLM frees: the tail goes first
        return True
