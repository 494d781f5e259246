"""Execute a Leyline splice (or compose) inside SGLang's scheduler, on its real pools and tree.

All-or-nothing: the protocol's algebra gives the new tokens and each run's KV source; both
sequences' tree paths are locked; kept runs (and a composed block past its seam) are copied
into fresh page-aligned slots with their rope band rotated, inserted runs written or asked
of a generate (``pending_prefill``); then the full pages go into the tree, in the new
namespace. Any failure before the insert frees and unlocks everything. docs/sglang.md has
the steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.algebra import Edit, EditResult, Run, apply_edits
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.fallback import FallbackReason
from leyline.sglang.kv_rows import KVRows
from leyline.sglang.link import BlockSource
from leyline.sglang.page_align import ceil_page, floor_page
from leyline.sglang.tree_ops import Match, TreeOps

#: Rows for one inserted run, per layer, as ``KVRows.write`` takes them; keyed by the run's
#: start position in the new sequence.
InsertedRows = Mapping[int, Sequence[Sequence[torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class TreeSplice:
    """What a splice did in the radix tree: what it reused, moved, and left to prefill."""

    tokens: tuple[int, ...]
    """The whole new sequence."""
    cached_tokens: int
    """How much of it the tree now holds (whole pages)."""
    reused_tokens: int
    """Tokens of the new sequence whose KV came from the old one (the prefix included)."""
    rotated_tokens: int
    """Reused tokens this call moved (rope band rotated)."""
    written_tokens: int
    """Inserted tokens written from caller-supplied rows."""
    pending_prefill: int | None = None
    """Set when an inserted run has no KV: prefill ``tokens[:pending_prefill]``, call again."""
    fallback_reason: FallbackReason | None = None
    """``page_alignment`` when a partial last page is left for the generate to re-prefill."""


@dataclass(frozen=True, slots=True)
class _Segment:
    new_start: int
    new_end: int
    src_start: int | None  # None: written from supplied rows
    delta: int
    rows: Sequence[Sequence[torch.Tensor]] | None = None
    source: Match | None = None
    """Whose slots ``src_start`` indexes: the old sequence's or a skill's."""


@dataclass(frozen=True, slots=True)
class _Piece:
    """A stretch of the new sequence with one KV source: the old sequence (``kept``), a
    skill's cached block (``skill``), or none (``fresh``: supplied rows or a prefill)."""

    kind: str
    new_start: int
    new_end: int
    src_start: int | None = None
    source: Match | None = None
    run_start: int | None = None
    """For a fresh piece that is a whole inserted run: its start (``inserted_rows`` key)."""

    @property
    def delta(self) -> int:
        return 0 if self.src_start is None else self.new_start - self.src_start

    @property
    def held_end(self) -> int:
        """Where the KV its source holds for it ends (a generation's sampled last token,
        or a partial last page, has none: a generate computes those)."""
        if self.source is None or self.src_start is None:
            return self.new_start
        return min(self.new_end, self.new_start + max(0, self.source.length - self.src_start))


class SpliceExecutor:
    """Splices on one scheduler's ``tree_cache``, KV pool rows and ``req_to_token_pool``."""

    def __init__(self, tree: TreeOps, rows: KVRows, req_to_token_pool: Any = None) -> None:
        self.tree = tree
        self.rows = rows
        self.req_to_token_pool = req_to_token_pool
        self.page_size = tree.page_size

    def splice(
        self,
        old_tokens: Sequence[int],
        edits: Sequence[Edit],
        *,
        inserted_rows: InsertedRows | None = None,
        blocks: Sequence[BlockSource] = (),
        old_salt: str | None = None,
        new_salt: str | None = None,
    ) -> TreeSplice:
        """Splice ``edits`` (AMORTIZE) into the cached ``old_tokens``.

        ``blocks``: the composed blocks among the inserted runs, with their cached source.
        ``old_salt`` / ``new_salt``: the namespaces of the old and the new sequence.

        Raises:
            LeylineError: the batch breaks a protocol rule, or the pool has no room
                (``limit_exceeded``); nothing changed.
            SpliceUnsupportedError: ``missing_source`` when the old sequence is no longer
                cached; nothing changed.
        """
        # With a FORGET in the batch (protocol 4, rule 6) everything from its start is a
        # ``recompute`` run: a fresh piece the generate prefills in context, after the kept
        # runs of the splices before it. The caller purges the forgotten span first.
        result = apply_edits(old_tokens, edits)
        new = result.tokens
        for block in blocks:
            if new[block.start : block.end] != block.tokens:
                raise LeylineError(
                    ErrorCode.invalid_directive,
                    f"the block at [{block.start}, {block.end}) is not its skill's tokens "
                    "(replaced meanwhile?): retry the batch",
                    "directives",
                )
        old_match = self.tree.match(old_tokens, old_salt)
        new_match = self.tree.match(new, new_salt)
        sources = [self.tree.match(b.source, b.salt) for b in blocks]  # skills' namespaces
        matches = [old_match, new_match, *sources]
        locks = [self.tree.lock(m.node) for m in matches]
        try:
            pieces = _pieces(result.runs, old_match, blocks, sources)
            return self._build(
                result, len(old_tokens), pieces, new_match, inserted_rows or {}, new_salt
            )
        finally:
            for handle in reversed(locks):
                self.tree.unlock(handle)

    def _build(
        self,
        result: EditResult,
        n_old: int,
        pieces: Sequence[_Piece],
        new_match: Match,
        inserted_rows: InsertedRows,
        new_salt: str | None,
    ) -> TreeSplice:
        new = result.tokens
        base = new_match.length
        segments, stop, pending = self._plan(pieces, base, n_old, len(new), inserted_rows)
        end = floor_page(stop, self.page_size)  # the tree takes whole pages only
        reason = self._reason(stop, pending)
        segments = [_clip(s, end) for s in segments if s.new_start < end]
        reused = sum(
            max(0, min(p.held_end, end) - p.new_start) for p in pieces if p.kind != "fresh"
        )
        rotated = sum(s.new_end - s.new_start for s in segments if s.delta != 0)
        written = sum(s.new_end - s.new_start for s in segments if s.src_start is None)
        if stop == len(new) and _last_needs_context(pieces, result.first_change, len(new)):
            # Protocol 3.1 (and 3.4): a moved last token must see its new context before
            # anything follows it. The tree is not given its copied KV, so every generate,
            # of these tokens or of more, computes it afresh (as it must for its logits).
            end = floor_page(stop - 1, self.page_size)
            reason = self._reason(stop - 1, pending)
            segments = [_clip(s, end) for s in segments if s.new_start < end]
        if end <= base:
            return TreeSplice(new, base, min(reused, base), 0, 0, pending, reason)
        fresh = self._alloc(end - base)
        try:
            for seg in segments:
                dst = fresh[seg.new_start - base : seg.new_end - base]
                if seg.src_start is None:
                    assert seg.rows is not None
                    self.rows.write(dst, seg.rows)
                else:
                    assert seg.source is not None
                    src = seg.source.slots[seg.src_start : seg.src_start + len(dst)]
                    self.rows.copy(src, dst, seg.delta)
            slots = self._token_row(torch.cat([new_match.slots[:base], fresh]))
        except BaseException:
            self.tree.allocator.free(fresh)
            raise
        self.tree.insert(new[:end], slots, owned=base, salt=new_salt)
        return TreeSplice(
            tokens=new,
            cached_tokens=end,
            reused_tokens=reused,
            rotated_tokens=rotated,
            written_tokens=written,
            pending_prefill=pending,
            fallback_reason=reason,
        )

    def _plan(
        self,
        pieces: Sequence[_Piece],
        base: int,
        n_old: int,
        n_new: int,
        inserted_rows: InsertedRows,
    ) -> tuple[list[_Segment], int, int | None]:
        """Segments to build from ``base`` on; where the build stops; what to prefill.

        The source is required only for what is built: the tree never holds a sequence's
        partial last page (nor a generation's last, sampled token), so a kept run reaching
        into them is built up to what is cached and the build stops there (the generate
        re-prefills the rest: a page's worth at most). A skill piece is already cut to what
        the tree holds of the skill.
        """
        page = self.page_size
        segments: list[_Segment] = []
        for i, piece in enumerate(pieces):
            if piece.new_end <= base:
                continue
            start = max(piece.new_start, base)
            if piece.kind != "fresh":
                source = piece.source
                assert piece.src_start is not None and source is not None
                src_start = piece.src_start + (start - piece.new_start)
                src_end = piece.src_start + (piece.new_end - piece.new_start)
                if piece.kind == "kept" and src_end > source.length:
                    # The tree never holds an old sequence's partial last page, nor the last
                    # token a generation sampled (its KV was never computed).
                    if source.length < floor_page(n_old - 1, page):
                        raise SpliceUnsupportedError(
                            FallbackReason.missing_source,
                            f"old tokens [{src_start}, {src_end}) are no "
                            f"longer cached (the tree holds {source.length})",
                        )
                    cut = max(start, piece.new_start + source.length - piece.src_start)
                    if cut > start:
                        segments.append(_Segment(start, cut, src_start, piece.delta, None, source))
                    want = min(ceil_page(piece.new_end, page), n_new)
                    if i + 1 < len(pieces) and floor_page(want, page) > cut:
                        # More follows (say, a block composed after the last turn): a
                        # generate computes the tokens that never had KV, then the build
                        # goes on, rather than leaving everything after them to it.
                        return segments, cut, want
                    return segments, cut, None
                segments.append(
                    _Segment(start, piece.new_end, src_start, piece.delta, None, source)
                )
            elif start == piece.run_start and start in inserted_rows:
                rows = inserted_rows[start]
                segments.append(_Segment(start, piece.new_end, None, 0, rows))
            else:
                # No KV for this piece: a generate up to the end of its last page prefills it
                # (a generate caches every whole page of its prompt, verified live). With page
                # size 1 that is exactly its end: one token more would give the first
                # downstream token fresh KV instead of its old KV rotated; with pages, the
                # downstream tokens sharing its last page get fresh KV, as the unchanged
                # tokens sharing the edit's first page do. If no whole page can be added
                # (the piece sits in the new sequence's partial last page), the build stops.
                want = min(ceil_page(piece.new_end, page), n_new)
                if floor_page(want, page) <= start:
                    return segments, start, None
                return segments, start, want
        return segments, n_new, None

    def _reason(self, stop: int, pending: int | None) -> FallbackReason | None:
        """``page_alignment`` when the build rounds down to a page: tokens it could have
        built (from cached KV) are left to the generate. A tail whose source was never
        cached (an old partial page, a generation's last token) is no fallback."""
        if pending is None and stop % self.page_size:
            return FallbackReason.page_alignment
        return None

    def _alloc(self, n: int) -> torch.Tensor:
        slots = self.tree.allocator.alloc(n)
        if slots is None:
            self.tree.evict(n)  # both paths are locked: eviction cannot take them
            slots = self.tree.allocator.alloc(n)
        if slots is None:
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"the KV pool has no room for the {n} slots this splice needs, even after "
                "eviction; retry later or send the edited prompt instead",
            )
        return cast(torch.Tensor, slots.to(torch.int64))

    def _token_row(self, slots: torch.Tensor) -> torch.Tensor:
        """Write the spliced sequence's token -> slot row, as a request of it would hold."""
        pool = self.req_to_token_pool
        if pool is None or len(slots) > pool.max_context_len:
            return slots
        rows = pool.alloc_rows(1)
        if not rows:
            return slots
        try:
            pool.write((rows[0], slice(0, len(slots))), slots.to(pool.req_to_token.dtype))
            return cast(torch.Tensor, pool.req_to_token[rows[0], : len(slots)].to(torch.int64))
        finally:
            pool.free_rows(rows)


def _pieces(
    runs: Sequence[Run],
    old: Match,
    blocks: Sequence[BlockSource],
    sources: Sequence[Match],
) -> list[_Piece]:
    """The new sequence, run by run, with each composed block split into its seam (fresh),
    the part the tree holds of its skill (copied, rotated) and the rest (fresh)."""
    pieces: list[_Piece] = []
    for run in runs:
        if run.kind == "kept":
            assert run.old_start is not None
            pieces.append(_Piece("kept", run.new_start, run.new_end, run.old_start, old))
            continue
        at = run.new_start
        inside = sorted(
            ((b, m) for b, m in zip(blocks, sources, strict=True)
             if run.new_start <= b.start and b.end <= run.new_end),
            key=lambda pair: pair[0].start,
        )  # fmt: skip
        if not inside:
            pieces.append(_Piece("fresh", at, run.new_end, run_start=at))
            continue
        for block, match in inside:
            if at < block.start:
                pieces.append(_Piece("fresh", at, block.start))
            held = max(0, min(len(block.source), match.length) - block.offset)
            body_start = block.start + min(block.seam, block.end - block.start)
            body_end = max(body_start, block.start + min(held, block.end - block.start))
            if block.start < body_start:
                pieces.append(_Piece("fresh", block.start, body_start))
            if body_start < body_end:
                src = block.offset + (body_start - block.start)
                pieces.append(_Piece("skill", body_start, body_end, src, match))
            if body_end < block.end:
                pieces.append(_Piece("fresh", body_end, block.end))
            at = block.end
        if at < run.new_end:
            pieces.append(_Piece("fresh", at, run.new_end))
    return pieces


def _last_needs_context(pieces: Sequence[_Piece], first_change: int, n_new: int) -> bool:
    """Whether the sequence's last token is copied KV from after the first change (moved,
    or a skill's): it did not attend to its new context."""
    last = pieces[-1] if pieces else None
    return last is not None and last.kind != "fresh" and n_new - 1 >= first_change


def _clip(seg: _Segment, end: int) -> _Segment:
    if seg.new_end <= end:
        return seg
    rows = seg.rows
    if rows is not None:
        keep = end - seg.new_start
        rows = [[t[:keep] for t in layer] for layer in rows]
    return _Segment(seg.new_start, end, seg.src_start, seg.delta, rows, seg.source)
