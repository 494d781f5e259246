"""The Leyline directive protocol: types, envelopes, errors, edit algebra, schema, client.

Depends on pydantic (and httpx for the client) only; nothing else of Leyline.
"""

from __future__ import annotations

from .algebra import (
    Edit,
    EditResult,
    PositionMap,
    Run,
    apply_edits,
    replacement_spans,
    validate_edits,
)
from .capabilities import PROTOCOL_VERSION, Capabilities, Limits, is_compatible
from .directives import (
    ComposeDirective,
    DecayDirective,
    Directive,
    ErratumDirective,
    ForgetDirective,
    Mode,
    PinDirective,
    RecomputeAttention,
    RecomputeDeviation,
    RecomputeMode,
    RecomputeNone,
    ScratchDirective,
    SpliceDirective,
    UnpinDirective,
    Verb,
    from_tuple,
    to_tuple,
)
from .envelope import (
    ComposedBlock,
    DroppedSpan,
    LeylineRequest,
    LeylineResponse,
    Path,
    RequestOptions,
    Timing,
)
from .errors import ErrorBody, ErrorCode, ErrorEnvelope, LeylineError
from .fallback import FallbackReason
from .resolve import ResolvedBatch, ResolvedCompose, ResolvedMark, resolve_batch
from .retention import Mark, Marks
from .spans import (
    InsertionPoint,
    MessageAnchor,
    MessagePoint,
    MessageSpan,
    Replacement,
    TokenSpan,
)
from .validation import parse_directives, parse_model

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "ComposeDirective",
    "ComposedBlock",
    "DecayDirective",
    "Directive",
    "DroppedSpan",
    "Edit",
    "EditResult",
    "ErratumDirective",
    "ErrorBody",
    "ErrorCode",
    "ErrorEnvelope",
    "FallbackReason",
    "ForgetDirective",
    "InsertionPoint",
    "LeylineError",
    "LeylineRequest",
    "LeylineResponse",
    "Limits",
    "Mark",
    "Marks",
    "MessageAnchor",
    "MessagePoint",
    "MessageSpan",
    "Mode",
    "Path",
    "PinDirective",
    "PositionMap",
    "RecomputeAttention",
    "RecomputeDeviation",
    "RecomputeMode",
    "RecomputeNone",
    "Replacement",
    "RequestOptions",
    "ResolvedBatch",
    "ResolvedCompose",
    "ResolvedMark",
    "Run",
    "ScratchDirective",
    "SpliceDirective",
    "Timing",
    "TokenSpan",
    "UnpinDirective",
    "Verb",
    "apply_edits",
    "from_tuple",
    "is_compatible",
    "parse_directives",
    "parse_model",
    "replacement_spans",
    "resolve_batch",
    "to_tuple",
    "validate_edits",
]
