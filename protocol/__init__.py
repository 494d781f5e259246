"""The Leyline directive protocol: types, envelopes, errors, edit algebra, schema, client.

Depends on pydantic (and httpx for the client) only; nothing else of Leyline.
"""

from __future__ import annotations

from .algebra import Edit, EditResult, PositionMap, Run, apply_edits, validate_edits
from .capabilities import PROTOCOL_VERSION, Capabilities, Limits, is_compatible
from .directives import (
    ComposeDirective,
    DecayDirective,
    Directive,
    ErratumDirective,
    ForgetDirective,
    Mode,
    PinDirective,
    ScratchDirective,
    SpliceDirective,
    Verb,
    from_tuple,
    to_tuple,
)
from .envelope import LeylineRequest, LeylineResponse, Path, RequestOptions
from .errors import ErrorBody, ErrorCode, ErrorEnvelope, LeylineError
from .fallback import FallbackReason
from .resolve import ResolvedBatch, resolve_batch
from .spans import MessageAnchor, MessageSpan, Replacement, TokenSpan
from .validation import parse_directives, parse_model

__all__ = [
    "PROTOCOL_VERSION",
    "Capabilities",
    "ComposeDirective",
    "DecayDirective",
    "Directive",
    "Edit",
    "EditResult",
    "ErratumDirective",
    "ErrorBody",
    "ErrorCode",
    "ErrorEnvelope",
    "FallbackReason",
    "ForgetDirective",
    "LeylineError",
    "LeylineRequest",
    "LeylineResponse",
    "Limits",
    "MessageAnchor",
    "MessageSpan",
    "Mode",
    "Path",
    "PinDirective",
    "PositionMap",
    "Replacement",
    "RequestOptions",
    "ResolvedBatch",
    "Run",
    "ScratchDirective",
    "SpliceDirective",
    "TokenSpan",
    "Verb",
    "apply_edits",
    "from_tuple",
    "is_compatible",
    "parse_directives",
    "parse_model",
    "resolve_batch",
    "to_tuple",
    "validate_edits",
]
