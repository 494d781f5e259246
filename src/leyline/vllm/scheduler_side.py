"""The connector's engine-core half: reads each request's order, purges, plans and pins the
rows to load, and answers in ``request_finished``.

vLLM calls, per request: ``on_new_request`` once when it is added (the purge runs here,
before any lookup); ``get_num_new_matched_tokens`` at admission, after its own prefix lookup,
maybe more than once; ``update_state_after_alloc`` with the request's blocks;
``build_connector_meta`` once per step; ``request_finished`` once, before the blocks are freed.

Skills' blocks are held (``holds``): a request's hold order is taken in its
``request_finished`` on the blocks it computed; a release runs in ``on_new_request``; a
load may read a hold's rows by its key.

A row can be loaded when its source block is cached. The source blocks are pinned (their
reference count raised, as a prefix hit does) from the first lookup until the worker reports
the step that loaded them, because the request's own allocation could otherwise hand an
unpinned cached block out in the same step. Loads are synchronous: the worker writes the
rows before the forward of the step whose metadata carries them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.request import Request

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.holds import HoldResult, Holds
from leyline.vllm.link import Answer, LoadSource, Order, RowMoves, order_from_actions
from leyline.vllm.sources import BlockSources

Row = tuple[int, int, int]
"""(source block id, offset in it, shift) of one destination position."""


@dataclass
class _Pending:
    """One request's order and what became of it."""

    order: Order
    rows: dict[int, Row | None] | None = None
    """Destination position -> its row, or None where the source block is gone."""
    pinned: list[KVCacheBlock] = field(default_factory=list)
    local: int = 0
    """Tokens vLLM's own lookup found, as of the last ``get_num_new_matched_tokens``."""
    reused: int = 0
    rotated: int = 0
    missing_from: int | None = None
    purged_blocks: int = 0
    fallback: SpliceUnsupportedError | None = None
    error: str = ""
    hold: HoldResult | None = None

    def answer(self) -> Answer:
        reason = self.fallback.reason.value if self.fallback is not None else None
        if reason is None and self.missing_from is not None:
            reason = FallbackReason.missing_source.value
        message = self.fallback.message if self.fallback is not None else self.error
        hold = self.hold or HoldResult()
        return Answer(
            self.reused,
            self.rotated,
            self.missing_from,
            reason,
            self.purged_blocks,
            message or hold.message,
            hold.held,
            hold.error,
            hold.released,
        )


class SchedulerSide:
    """Orders of the requests in flight, over the scheduler's ``BlockPool``."""

    def __init__(self, kv_cache_config: Any, hash_algo: str) -> None:
        self._kv_cache_config = kv_cache_config
        self._hash_algo = hash_algo
        self._sources: BlockSources | None = None
        self._holds: Holds | None = None
        self._refusal: SpliceUnsupportedError | None = SpliceUnsupportedError(
            FallbackReason.unsupported_runtime, "the connector has no block pool yet"
        )
        self._pending: dict[str, _Pending] = {}
        self._rows: list[tuple[int, int, int, int, int]] = []
        self._loading: list[str] = []
        self._shipped: deque[list[str]] = deque()
        """Per step whose metadata carried rows: the requests whose pins it holds."""

    @property
    def refusal(self) -> SpliceUnsupportedError | None:
        """Why every order is refused (no pool, a cache sources cannot address, a worker
        that cannot write rows), or None."""
        return self._refusal

    def bind(self, pool: BlockPool) -> None:
        try:
            self._sources = BlockSources.for_cache(self._kv_cache_config, self._hash_algo, pool)
            self._holds = Holds(pool, self._sources.block_size)
            self._refusal = None
        except SpliceUnsupportedError as refused:
            self._refusal = refused

    def refuse(self, refused: SpliceUnsupportedError) -> None:
        """From now on refuse every order (the worker cannot write rows)."""
        self._refusal = refused

    def on_new_request(self, request: Request) -> None:
        hints = request.kv_hints
        try:
            order = None if hints is None else order_from_actions(hints.actions)
        except ValueError as exc:
            self._pending[request.request_id] = _Pending(Order(), error=f"invalid order: {exc}")
            return
        if order is None:
            return
        pending = _Pending(order)
        self._pending[request.request_id] = pending
        for key in order.release:  # a deleted skill: never refused, so nothing stays held
            if self._holds is not None:
                self._holds.release(key)
        if self._refusal is not None or self._sources is None:
            pending.fallback = self._refusal
            return
        for target in order.purge:
            evicted = self._sources.purge_from(target.salt, target.tokens, target.from_position)
            pending.purged_blocks += len(evicted)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Destination rows past ``num_computed_tokens`` that can be loaded: consecutive
        planned positions whose source block is cached, never the prompt's last token."""
        pending = self._pending.get(request.request_id)
        if pending is None or not pending.order.load or pending.fallback is not None:
            return 0
        if self._refusal is not None:
            pending.fallback = self._refusal
            return 0
        if not pending.pinned:  # first lookup, or again after the load ran (preempted)
            self._plan_and_pin(pending)
        assert pending.rows is not None
        pending.local = num_computed_tokens
        pending.missing_from = None
        last = request.num_tokens - 1
        position = num_computed_tokens
        while position < last and position in pending.rows:
            if pending.rows[position] is None:
                pending.missing_from = position
                break
            position += 1
        return position - num_computed_tokens

    def _plan_and_pin(self, pending: _Pending) -> None:
        assert self._sources is not None
        pool = self._sources.pool
        block_size = self._sources.block_size
        rows: dict[int, Row | None] = {}
        used: dict[int, KVCacheBlock] = {}
        for source in pending.order.load:
            cached, available = self._source_blocks(source)
            for run in source.runs:
                for k in range(run.length):
                    at = run.source_start + k
                    index = at // block_size
                    if at >= available or index >= len(cached):
                        rows[run.dest_start + k] = None
                        continue
                    used[cached[index]] = pool.blocks[cached[index]]
                    rows[run.dest_start + k] = (cached[index], at % block_size, run.shift)
        pending.rows = rows
        pending.pinned = list(used.values())
        pool.touch(pending.pinned)

    def _source_blocks(self, source: LoadSource) -> tuple[list[int], int]:
        """The block ids holding the source's rows, in order, and how many rows they hold: a
        cached sequence's full blocks (by hash), or a hold's blocks (by id; none once it is
        released, so its rows are then missing)."""
        assert self._sources is not None
        if source.hold is None:
            cached = self._sources.cached_prefix(source.salt, source.tokens)
            return cached, len(cached) * self._sources.block_size
        held = self._holds.get(source.hold) if self._holds is not None else None
        if held is None:
            return [], 0
        return [block.block_id for block in held.blocks], held.rows

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """Record the rows to move into the request's blocks ``block_ids``."""
        pending = self._pending.get(request.request_id)
        if pending is None:
            return
        if num_external_tokens == 0:
            self._unpin(pending)  # scheduled with nothing to load: nothing to hold
            return
        assert pending.rows is not None
        block_size = self._sources.block_size if self._sources is not None else 1
        for position in range(pending.local, pending.local + num_external_tokens):
            row = pending.rows[position]
            assert row is not None
            block, offset, shift = row
            self._rows.append(
                (block, offset, block_ids[position // block_size], position % block_size, shift)
            )
            pending.rotated += shift != 0
        pending.reused += num_external_tokens
        self._loading.append(request.request_id)

    def build_connector_meta(self) -> RowMoves:
        """This step's rows; their pins are held until the worker reports the step."""
        moves = RowMoves.of(self._rows)
        if moves:
            self._shipped.append(self._loading)
        self._rows, self._loading = [], []
        return moves

    def loads_done(self, refused: SpliceUnsupportedError | None) -> None:
        """The worker ran the oldest step with rows (``refused``: it wrote none of them)."""
        if not self._shipped:
            return
        for request_id in self._shipped.popleft():
            pending = self._pending.get(request_id)
            if pending is None:
                continue
            self._unpin(pending)
            if refused is not None:
                pending.fallback, pending.reused, pending.rotated = refused, 0, 0
        if refused is not None:
            self.refuse(refused)

    def request_finished(self, request: Request, block_ids: list[int]) -> Answer | None:
        """Unpin what the request still holds, take its hold on ``block_ids`` (its blocks
        covering the tokens it computed, still referenced by it); its answer, when it
        carried an order."""
        pending = self._pending.pop(request.request_id, None)
        if pending is None:
            return None
        self._unpin(pending)
        hold = pending.order.hold
        if hold is not None:
            if self._holds is None or pending.fallback is not None or pending.error:
                why = pending.fallback.message if pending.fallback else pending.error
                pending.hold = HoldResult(error="splice_refused", message=why or "no pool")
            elif request.num_computed_tokens < hold.rows:
                message = f"the prefill computed {request.num_computed_tokens} of {hold.rows}"
                pending.hold = HoldResult(error="splice_refused", message=message)
            else:
                pending.hold = self._holds.take(hold, block_ids)
        return pending.answer()

    def _unpin(self, pending: _Pending) -> None:
        if pending.pinned and self._sources is not None:
            self._sources.pool.free_blocks(pending.pinned)
        pending.pinned = []
