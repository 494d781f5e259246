"""The directive verbs, as one pydantic union discriminated on ``verb``.

The paper's tuple ``(start, end, replacement, mode)`` maps exactly onto ``splice``
(mode AMORTIZE) and ``forget`` (mode FORGET): see :func:`from_tuple` / :func:`to_tuple`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from .spans import InsertionPoint, MessageAnchor, Replacement, Span, TokenSpan


class Verb(StrEnum):
    splice = "splice"
    forget = "forget"
    erratum = "erratum"
    compose = "compose"
    pin = "pin"
    unpin = "unpin"
    decay = "decay"
    scratch = "scratch"


class Mode(StrEnum):
    """The paper's mode ``m`` of a directive tuple."""

    amortize = "amortize"
    forget = "forget"


class _Directive(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpliceDirective(_Directive):
    """AMORTIZE: replace ``span`` with ``replacement`` and keep the downstream KV.

    Downstream tokens move by ``delta = len(replacement) - len(span)``; their keys are
    re-rotated, never recomputed, so they keep the influence of the removed content.
    An empty replacement deletes the span; an empty span inserts.
    """

    verb: Literal["splice"] = "splice"
    span: Span
    replacement: Replacement = ""


class ForgetDirective(_Directive):
    """FORGET: replace ``span`` and re-prefill everything after its start.

    Nothing derived from the removed tokens survives, in this session or in any cache
    entry shared with others that no other session references.
    """

    verb: Literal["forget"] = "forget"
    span: Span
    replacement: Replacement = ""


class ErratumDirective(_Directive):
    """Append a correction after the cached sequence; the prefix stays byte-identical.

    ``text`` is appended as is. :meth:`for_field` renders the canonical note
    ``[STATE UPDATE] field -> value; overrides the earlier value``. ``corrects`` optionally
    names the span the note supersedes (informational; it must exist in the base revision).
    """

    verb: Literal["erratum"] = "erratum"
    text: Replacement = Field(min_length=1)
    corrects: Span | None = None

    @classmethod
    def for_field(
        cls, field: str, value: str, corrects: TokenSpan | MessageAnchor | None = None
    ) -> ErratumDirective:
        note = f"\n[STATE UPDATE] {field} -> {value}; overrides the earlier value.\n"
        return cls(text=note, corrects=corrects)


class RecomputeMode(StrEnum):
    """How much of a composed block past its seam is recomputed in context."""

    none = "none"
    deviation = "deviation"
    attention = "attention"


class RecomputeNone(_Directive):
    """Recompute only the seam: every other block token keeps its precompiled, rotated KV."""

    mode: Literal["none"]


def _ratio_field(chosen: str) -> Any:
    """A selective mode's ``ratio``: a fraction in (0, 1], default 0.15, and how it picks."""
    return Field(
        default=0.15,
        gt=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Fraction of the block's tokens past the seam to recompute (rounded up), "
        + chosen,
    )


class RecomputeDeviation(_Directive):
    """Also recompute the block tokens whose KV deviates most in context (after CacheBlend)."""

    mode: Literal["deviation"]
    ratio: float = _ratio_field(
        "chosen as those whose KV deviates most from their in-context KV at an early layer."
    )


class RecomputeAttention(_Directive):
    """Also recompute the block tokens that the tokens after the block read most."""

    mode: Literal["attention"]
    ratio: float = _ratio_field(
        "chosen as those the tokens following the block in this request (a turn's question) "
        "give the most attention to. Nothing follows the block: only the seam is recomputed."
    )


Recompute = Annotated[
    RecomputeNone | RecomputeDeviation | RecomputeAttention, Field(discriminator="mode")
]
"""Selective recompute past a composed block's seam: ``{"mode": "none"}`` (default),
``{"mode": "deviation", "ratio": 0.15}`` or ``{"mode": "attention", "ratio": 0.15}``. A
server that does not execute the mode refuses the batch with ``unsupported_option``; it
never falls back to another mode silently."""

SelectiveRecompute = RecomputeDeviation | RecomputeAttention
"""The recompute modes that choose a share of the block (they carry a ``ratio``)."""


MAX_SEAM_TOKENS = 256
"""The largest ``seam_tokens`` a compose may ask for."""


class ComposeDirective(_Directive):
    """Insert a precompiled KV block (a registered "skill") at insertion point ``at``.

    The block's KV was computed once from position 0; its keys are rotated to their new
    positions, its first ``seam_tokens`` tokens are recomputed against the preceding context
    (and more per ``recompute``), and downstream tokens shift as in a splice (AMORTIZE).
    """

    verb: Literal["compose"] = "compose"
    skill: str = Field(
        min_length=1, max_length=128, description="Id of a skill registered by this tenant."
    )
    at: InsertionPoint = Field(
        description="Insertion point in the base revision: a token position, "
        '{"message": i, "part": ..., "edge": "start"|"end"}, or "end".'
    )
    seam_tokens: int = Field(
        default=4,
        ge=0,
        le=MAX_SEAM_TOKENS,
        description="Leading block tokens recomputed against the preceding context (the "
        "seam); more than the block has recomputes all of it.",
    )
    recompute: Recompute = Field(
        default_factory=lambda: RecomputeNone(mode="none"),
        description="Selective recompute past the seam; default none.",
    )


MAX_PIN_TTL_S = 7 * 24 * 3600.0
"""The longest ``ttl_s`` a pin may ask for (a week)."""

MAX_DECAY_PRIORITY = 1_000_000


class PinDirective(_Directive):
    """Keep ``span`` as it is: edits that touch it are refused (``pinned_span``) and its
    session is evicted last (never while ``ttl_s`` runs)."""

    verb: Literal["pin"] = "pin"
    span: Span
    ttl_s: float | None = Field(
        default=None,
        gt=0.0,
        le=MAX_PIN_TTL_S,
        allow_inf_nan=False,
        description="Seconds the pin holds; none: until unpinned. While it holds, the "
        "session is never evicted.",
    )


class UnpinDirective(_Directive):
    """Remove every pin that overlaps ``span`` (none is not an error)."""

    verb: Literal["unpin"] = "unpin"
    span: Span


class DecayDirective(_Directive):
    """``span`` may be dropped under memory pressure (lowest ``priority`` first), executed
    as ``mode`` with ``replacement``, before any whole session is evicted."""

    verb: Literal["decay"] = "decay"
    span: Span
    priority: int = Field(
        default=0,
        ge=0,
        le=MAX_DECAY_PRIORITY,
        description="Lower is dropped first; ties go oldest mark first.",
    )
    mode: Mode = Field(default=Mode.forget, description="How the drop is executed.")
    replacement: Replacement = Field(
        default="", description="What the span becomes when dropped (a stub); default empty."
    )


class ScratchDirective(_Directive):
    """``span`` is visible to the generation that follows, then dropped as ``mode`` with
    ``replacement`` when that generation completes."""

    verb: Literal["scratch"] = "scratch"
    span: Span
    mode: Mode = Field(default=Mode.forget, description="How the drop is executed.")
    replacement: Replacement = Field(
        default="", description="What the span becomes when dropped; default empty."
    )


RetentionDirective = PinDirective | UnpinDirective | DecayDirective | ScratchDirective
"""The verbs that mark a span without changing a token (docs/protocol.md, 3.5)."""


Directive = Annotated[
    SpliceDirective
    | ForgetDirective
    | ErratumDirective
    | ComposeDirective
    | PinDirective
    | UnpinDirective
    | DecayDirective
    | ScratchDirective,
    Field(discriminator="verb"),
]

DIRECTIVE_ADAPTER: TypeAdapter[Directive] = TypeAdapter(Directive)
DIRECTIVE_LIST_ADAPTER: TypeAdapter[list[Directive]] = TypeAdapter(list[Directive])

#: Verbs that change the token sequence (the edit algebra executes them).
EDITING_VERBS = frozenset({Verb.splice, Verb.forget, Verb.erratum, Verb.compose})
#: Verbs that mark a span without changing a token (``protocol.retention`` keeps them).
RETENTION_VERBS = frozenset({Verb.pin, Verb.unpin, Verb.decay, Verb.scratch})


def from_tuple(
    start: int, end: int, replacement: Replacement, mode: Mode | str = Mode.amortize
) -> SpliceDirective | ForgetDirective:
    """The paper's ``D = (s_start, s_end, R, m)`` as a directive."""
    span = TokenSpan(start=start, end=end)
    if Mode(mode) is Mode.amortize:
        return SpliceDirective(span=span, replacement=replacement)
    return ForgetDirective(span=span, replacement=replacement)


def to_tuple(directive: SpliceDirective | ForgetDirective) -> tuple[int, int, Replacement, Mode]:
    """The inverse of :func:`from_tuple`; only token-addressed spans have a tuple form."""
    if not isinstance(directive.span, TokenSpan):
        raise ValueError("a message-anchored directive has no token tuple until resolved")
    mode = Mode.amortize if isinstance(directive, SpliceDirective) else Mode.forget
    return directive.span.start, directive.span.end, directive.replacement, mode
