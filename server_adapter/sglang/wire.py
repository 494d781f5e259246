"""The control request a Leyline splice travels in, server process -> scheduler, and back.

SGLang's IPC encodes msgspec structs tagged by class name; ``hook_custom_types`` adds ours
to its decoder. The names follow SGLang's ``...ReqInput`` / ``...ReqOutput`` convention.
Imports SGLang: import this module only inside an SGLang process (or its test venv).
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

from leyline.protocol.algebra import Edit

from .backend import SchedulerAnswer

#: ``(start, end, replacement token ids)`` in the old sequence's coordinates.
WireEdit = tuple[int, int, list[int]]


# SGLang is not installed where mypy runs, so ``BaseReq`` (a msgspec Struct) is Any there.
class LeylineSpliceReqInput(BaseReq, kw_only=True):  # type: ignore[misc, call-arg]
    verb: str  # "splice" or "forget"
    old_tokens: list[int]
    edits: list[WireEdit]


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


hook_custom_types(LeylineSpliceReqInput, LeylineSpliceReqOutput)


def to_wire(verb: str, old_tokens: Sequence[int], edits: Sequence[Edit]) -> LeylineSpliceReqInput:
    wire = [(e.start, e.end, list(e.replacement)) for e in edits]
    return LeylineSpliceReqInput(verb=verb, old_tokens=list(old_tokens), edits=wire)


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
    )
