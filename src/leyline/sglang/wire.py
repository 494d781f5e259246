"""The control request a Leyline splice travels in, server process -> scheduler, and back.

SGLang's IPC encodes msgspec structs tagged by class name; ``hook_custom_types`` adds ours
to its decoder. The names follow SGLang's ``...ReqInput`` / ``...ReqOutput`` convention.
Imports SGLang: import this module only inside an SGLang process (or its test venv).
"""

from __future__ import annotations

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from leyline.protocol.directives import Mode
from leyline.sglang.link import BlockSource, SchedulerAnswer, SchedulerOrder

#: ``(start, end, replacement token ids)`` in the old sequence's coordinates.
WireEdit = tuple[int, int, list[int]]
#: A ``BlockSource``: ``(start, end, source tokens, offset, seam, salt)``.
WireBlock = tuple[int, int, list[int], int, int, str | None]


# SGLang is not installed where mypy runs, so ``BaseReq`` (a msgspec Struct) is Any there.
class LeylineSpliceReqInput(BaseReq, kw_only=True):  # type: ignore[misc, call-arg]
    verb: str  # "splice", "forget", "hold" or "release"
    old_tokens: list[int]
    edits: list[WireEdit]
    forgets: list[int] = msgspec.field(default_factory=list)
    """``splice``: which of ``edits`` are FORGETs (a mixed batch; the rest AMORTIZE)."""
    blocks: list[WireBlock] = msgspec.field(default_factory=list)
    old_salt: str | None = None
    """The old sequence's namespace (``hold``: the held tokens')."""
    new_salt: str | None = None
    key: str = ""
    """``hold`` / ``release``: the name the scheduler keeps a held sequence's lock under."""
    evictable: list[str] = msgspec.field(default_factory=list)
    """``hold``: keys it may release to make room, least recently used first."""


class LeylineSpliceReqOutput(BaseReq, kw_only=True):  # type: ignore[misc, call-arg]  # as above
    ok: bool
    tokens: list[int] = msgspec.field(default_factory=list)
    cached_tokens: int = 0
    reused_tokens: int = 0
    rotated_tokens: int = 0
    pending_prefill: int | None = None
    fallback_reason: str | None = None
    """A protocol fallback reason: the splice did not run (or not all of it)."""
    error_code: str | None = None
    """A protocol error code: the batch was rejected."""
    error_field: str | None = None
    message: str = ""
    released: list[str] = msgspec.field(default_factory=list)
    """``hold``: the keys it released to make room."""


hook_custom_types(LeylineSpliceReqInput, LeylineSpliceReqOutput)


def to_wire(order: SchedulerOrder) -> LeylineSpliceReqInput:
    return LeylineSpliceReqInput(
        verb=order.verb,
        old_tokens=list(order.old_tokens),
        edits=[(e.start, e.end, list(e.replacement)) for e in order.edits],
        forgets=[i for i, e in enumerate(order.edits) if e.mode is Mode.forget],
        blocks=[(b.start, b.end, list(b.source), b.offset, b.seam, b.salt) for b in order.blocks],
        old_salt=order.old_salt,
        new_salt=order.new_salt,
        key=order.key,
        evictable=list(order.evictable),
    )


def blocks_of(req: LeylineSpliceReqInput) -> list[BlockSource]:
    return [
        BlockSource(s, e, tuple(src), off, seam, salt) for s, e, src, off, seam, salt in req.blocks
    ]


def from_wire(out: LeylineSpliceReqOutput) -> SchedulerAnswer:
    return SchedulerAnswer(
        ok=out.ok,
        cached_tokens=out.cached_tokens,
        reused_tokens=out.reused_tokens,
        rotated_tokens=out.rotated_tokens,
        pending_prefill=out.pending_prefill,
        fallback_reason=out.fallback_reason,
        error_code=out.error_code,
        error_field=out.error_field,
        message=out.message,
        released=tuple(out.released),
    )
