"""The typed error model shared by every Leyline server and client.

Every rejection carries a stable ``code`` (clients branch on it), a message that says what
to change, and the ``field`` (a dotted path into the request) that broke the rule.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict


class ErrorCode(StrEnum):
    """Stable error codes. Adding a code is a minor protocol change; renaming one is major."""

    invalid_directive = "invalid_directive"
    """The body does not match the schema (wrong type, missing or extra field, unknown verb)."""
    invalid_span = "invalid_span"
    """A span is out of range for the base revision, reversed, or changes nothing."""
    overlapping_directives = "overlapping_directives"
    """Two directives of one batch address overlapping tokens."""
    empty_batch = "empty_batch"
    """A request that must carry directives carried none."""
    too_many_directives = "too_many_directives"
    replacement_too_long = "replacement_too_long"
    unresolved_anchor = "unresolved_anchor"
    """A message anchor names a message or part the revision does not have."""
    revision_conflict = "revision_conflict"
    """The batch was addressed to a revision that is no longer current."""
    unknown_session = "unknown_session"
    unsupported_verb = "unsupported_verb"
    """The server knows the verb but does not execute it; it never ignores one silently."""
    unsupported_option = "unsupported_option"
    """The server executes the verb but not this option of it (e.g. a compose recompute mode)."""
    unknown_skill = "unknown_skill"
    """No skill with that id is registered for the caller's tenant."""
    skill_mismatch = "skill_mismatch"
    """The skill is bound to another model, tokenizer or chat template than the session's."""
    pinned_span = "pinned_span"
    """An edit touches a pinned span (unpin it first, or edit elsewhere)."""
    session_too_long = "session_too_long"
    limit_exceeded = "limit_exceeded"
    """A server limit other than the ones above (body size, sessions, cache memory)."""
    incompatible_version = "incompatible_version"
    unauthorized = "unauthorized"
    """The server requires an API key and the request carried none or a wrong one."""
    splice_refused = "splice_refused"
    """The engine cannot splice exactly here and the request set ``allow_fallback: false``."""
    not_found = "not_found"
    """No route at that path."""
    method_not_allowed = "method_not_allowed"
    """The route exists but not for that HTTP method (the ``Allow`` header lists them)."""
    internal_error = "internal_error"
    """The server failed on its own, not because of the request; the server logged it."""


#: The HTTP status a server answers with for each code.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.invalid_directive: 422,
    ErrorCode.invalid_span: 422,
    ErrorCode.overlapping_directives: 422,
    ErrorCode.empty_batch: 422,
    ErrorCode.too_many_directives: 413,
    ErrorCode.replacement_too_long: 413,
    ErrorCode.unresolved_anchor: 422,
    ErrorCode.revision_conflict: 409,
    ErrorCode.unknown_session: 404,
    ErrorCode.unsupported_verb: 501,
    ErrorCode.unsupported_option: 501,
    ErrorCode.unknown_skill: 404,
    ErrorCode.skill_mismatch: 409,
    ErrorCode.pinned_span: 409,
    ErrorCode.session_too_long: 413,
    ErrorCode.limit_exceeded: 413,
    ErrorCode.incompatible_version: 400,
    ErrorCode.unauthorized: 401,
    ErrorCode.splice_refused: 422,
    ErrorCode.not_found: 404,
    ErrorCode.method_not_allowed: 405,
    ErrorCode.internal_error: 500,
}


class ErrorBody(BaseModel):
    """The wire form of an error: ``{"error": {"type": "leyline_error", "code": ...}}``."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    type: Literal["leyline_error"] = "leyline_error"
    code: ErrorCode
    message: str
    field: str | None = None


class ErrorEnvelope(BaseModel):
    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    error: ErrorBody


class LeylineError(Exception):
    """A request broke a protocol rule. Raising it must leave every cache as it was."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(f"{code}: {message}" + (f" (at {field})" if field else ""))
        self.code = code
        self.message = message
        self.field = field

    @property
    def http_status(self) -> int:
        return HTTP_STATUS[self.code]

    def to_body(self) -> ErrorEnvelope:
        body = ErrorBody(code=self.code, message=self.message, field=self.field)
        return ErrorEnvelope(error=body)

    @classmethod
    def from_body(cls, envelope: ErrorEnvelope) -> LeylineError:
        body = envelope.error
        return cls(body.code, body.message, body.field)
