"""The ``leyline`` object carried in an OpenAI-style request body, and the one answered."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, model_serializer

from .directives import Directive
from .fallback import FallbackReason
from .spans import MessageSpan


class RequestOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    infer_splices: bool = Field(
        default=False,
        description=(
            "Infer splices from the difference between this request's messages and the "
            "session's last revision. Opt-in: AMORTIZE keeps the removed content's influence."
        ),
    )
    allow_fallback: bool = Field(
        default=True,
        description="When a splice cannot run, re-prefill and report why (false: fail instead).",
    )
    require_session: bool = Field(
        default=False,
        description=(
            "The named session must exist: an unknown one is unknown_session (404) instead of "
            "being created by a request without directives. Only for a server whose "
            "capabilities say require_session: true."
        ),
    )

    @model_serializer(mode="wrap")
    def _omit_unset_require_session(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Left out when false, so a client sends a server of 1.0 without the flag exactly
        # what it sent before the option existed (requests are strict there: extra="forbid").
        data = handler(self)
        if isinstance(data, dict) and not self.require_session:
            data.pop("require_session", None)
        return data


class LeylineRequest(BaseModel):
    """Sent as ``extra_body={"leyline": {...}}`` with chat or completion requests."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    session: str | None = Field(
        default=None, min_length=1, max_length=128, description="Session id; none = stateless."
    )
    base_revision: int | None = Field(
        default=None, ge=0, description="Revision the directives address; required with any."
    )
    directives: list[Directive] = Field(default_factory=list)
    options: RequestOptions = Field(default_factory=RequestOptions)


class Path(StrEnum):
    """Which path produced the cache the request ran on."""

    splice = "splice"
    """Downstream KV was kept and re-rotated."""
    reprefill = "reprefill"
    """Everything from the first changed token was prefilled again."""
    prefix_hit = "prefix_hit"
    """The request extended the cached sequence; nothing cached was recomputed."""


class DroppedSpan(BaseModel):
    """A ``decay`` or ``scratch`` span the server dropped (docs/protocol.md, 3.5)."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    verb: str = Field(description="decay (under memory pressure) or scratch (end of turn).")
    start: int = Field(ge=0, description="First token of the span, in the revision before.")
    end: int = Field(ge=0, description="One past its last token, in the revision before.")
    revision: int = Field(ge=0, description="The revision the drop made.")
    replacement_tokens: int = Field(ge=0, description="Tokens of the stub left in its place.")


class ComposedBlock(BaseModel):
    """Where a ``compose`` of the batch put its skill's tokens in the new revision."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    directive: int = Field(ge=0, description="Index of the compose in its batch.")
    skill: str
    start: int = Field(ge=0, description="First token of the block (inclusive).")
    end: int = Field(ge=0, description="One past its last token; address it as a token span.")


class Timing(BaseModel):
    """Where a generation request's time went on the server (optional: a server that
    schedules its model work says so; docs/protocol.md, 6)."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    queued_s: float = Field(
        ge=0,
        description="Waiting for the model before and between the slices of its edit and prefill.",
    )
    service_s: float = Field(ge=0, description="Holding the model for the edit and prefill.")
    decode_s: float = Field(
        ge=0, description="The generation, its decode steps batched with other requests'."
    )


class LeylineResponse(BaseModel):
    """Every response carries one: what the server did and where each message now lies."""

    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)

    session: str | None = None
    revision: int = Field(ge=0)
    path: Path
    reused_tokens: int = Field(ge=0)
    prefilled_tokens: int = Field(ge=0)
    rotated_tokens: int = Field(ge=0)
    fallback_reason: FallbackReason | None = None
    spans: list[MessageSpan] = Field(default_factory=list)
    composed: list[ComposedBlock] = Field(
        default_factory=list,
        description="The blocks this request's compose directives inserted, in batch order.",
    )
    dropped: list[DroppedSpan] = Field(
        default_factory=list,
        description="Decay and scratch spans dropped since the session's last response, "
        "oldest first.",
    )
    timing: Timing | None = Field(
        default=None, description="Server time of a generation request, where measured."
    )
