"""Span addressing: exact token ranges of a revision, or message anchors a server resolves."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

TokenId = Annotated[int, Field(ge=0)]
"""A vocabulary index."""

Replacement = str | list[TokenId]
"""Replacement content: text (the server tokenizes it) or token ids (used as they are)."""

MessagePart = Literal["content", "tool_calls", "all"]


class TokenSpan(BaseModel):
    """Tokens ``[start, end)`` of the base revision the batch is addressed to."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    start: int = Field(ge=0, description="First token of the span (inclusive).")
    end: int = Field(ge=0, description="One past the last token of the span (exclusive).")

    @model_validator(mode="after")
    def _ordered(self) -> TokenSpan:
        if self.start > self.end:
            raise ValueError(f"start ({self.start}) must not exceed end ({self.end})")
        return self

    def __len__(self) -> int:
        return self.end - self.start


class MessageAnchor(BaseModel):
    """A message of the base revision, resolved by the server with its own chat template.

    ``part="all"`` (default) covers the whole rendered message, role header and end marker
    included; ``"content"`` covers only the content tokens; ``"tool_calls"`` only the
    rendered tool calls of an assistant message.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: int = Field(ge=0, description="Index into the revision's message list.")
    part: MessagePart = "all"


def _span_kind(value: Any) -> str | None:
    if isinstance(value, dict):
        return "message_anchor" if "message" in value else "token_span"
    if isinstance(value, MessageAnchor):
        return "message_anchor"
    if isinstance(value, TokenSpan):
        return "token_span"
    return None


Span = Annotated[
    Annotated[TokenSpan, Tag("token_span")] | Annotated[MessageAnchor, Tag("message_anchor")],
    Discriminator(_span_kind),
]
"""``{"start": s, "end": e}`` or ``{"message": i, "part": "content"}``."""


class MessagePoint(BaseModel):
    """An insertion point at an edge of a message of the base revision.

    ``{"message": i}`` is the start of message ``i`` (before its role header): a block
    inserted there comes before the message's own tokens. ``edge="end"`` is just after the
    part's last token; ``part`` picks which span of the message the edge belongs to, as in
    :class:`MessageAnchor` (``{"message": i, "part": "content"}`` is the first content token).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    message: int = Field(ge=0, description="Index into the revision's message list.")
    part: MessagePart = Field(default="all", description="Which span of the message.")
    edge: Literal["start", "end"] = Field(
        default="start", description="Its first token (start) or just past its last (end)."
    )

    def anchor(self) -> MessageAnchor:
        """The span whose edge this point is."""
        return MessageAnchor(message=self.message, part=self.part)


def _point_kind(value: Any) -> str:
    if isinstance(value, dict | MessagePoint):
        return "message_point"
    if isinstance(value, str):
        return "end_of_sequence"
    return "token_position"  # ints, and anything else the int validator then rejects


InsertionPoint = Annotated[
    Annotated[int, Field(ge=0), Tag("token_position")]
    | Annotated[MessagePoint, Tag("message_point")]
    | Annotated[Literal["end"], Tag("end_of_sequence")],
    Discriminator(_point_kind),
]
"""Where an insertion goes in the base revision: token position ``p`` (before token ``p``;
``p == length`` appends), a :class:`MessagePoint` ``{"message": i}``, or ``"end"`` (after
its last token)."""


class MessageSpan(BaseModel):
    """Where message ``message`` of a revision lies in its tokens, as the server rendered it."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    message: int = Field(ge=0)
    role: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    content: TokenSpan | None = None
    tool_calls: TokenSpan | None = None

    def part(self, part: MessagePart) -> TokenSpan | None:
        if part == "all":
            return TokenSpan(start=self.start, end=self.end)
        return self.content if part == "content" else self.tool_calls
