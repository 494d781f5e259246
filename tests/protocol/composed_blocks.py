"""Where a resolved batch's composes put their skills' tokens in the new revision (a
report's ``composed``), worked out with the protocol's own algebra: what the test servers
of ``test_conformance_compose`` and ``tests/policies/compose_server`` report."""

from __future__ import annotations

from leyline.protocol import ComposedBlock, replacement_spans
from leyline.protocol.resolve import ResolvedBatch


def composed_blocks(length: int, batch: ResolvedBatch) -> list[ComposedBlock]:
    """The blocks of ``batch``'s composes, in batch order, applied to ``length`` tokens."""
    placed = replacement_spans(length, batch.edits)
    where = {edit.index: span for edit, span in zip(batch.edits, placed, strict=True)}
    return [
        ComposedBlock(directive=c.index, skill=c.skill, start=where[c.index][0],
                      end=where[c.index][1])
        for c in batch.composes
    ]  # fmt: skip
