"""The control request a Leyline splice travels in, server process -> scheduler, and back.

SGLang's IPC encodes msgspec structs tagged by class name; ``hook_custom_types`` adds ours
to its decoder. The names follow SGLang's ``...ReqInput`` / ``...ReqOutput`` convention.
Imports SGLang: import this module only inside an SGLang process (or its test venv).
"""

from __future__ import annotations

import msgspec
from sglang.srt.managers.io_struct import BaseReq, hook_custom_types

#: ``(start, end, replacement token ids)`` in the old sequence's coordinates.
WireEdit = tuple[int, int, list[int]]


class LeylineSpliceReqInput(BaseReq, kw_only=True):
    verb: str  # "splice" or "forget"
    old_tokens: list[int]
    edits: list[WireEdit]


class LeylineSpliceReqOutput(BaseReq, kw_only=True):
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
