"""When a context policy fires, and how much it keeps: the knobs shared by
:class:`~.clear.ClearToolUses` and :class:`~.summarize.Summarize`.

A trigger is one threshold on the transcript, given in any of the forms other tools use::

    8000                                     # tokens (LangChain's ClearToolUsesEdit)
    {"tokens": 8000}  {"fraction": 0.8}  {"messages": 50}  {"tool_uses": 20}
    ["fraction", 0.8]                        # LangChain's SummarizationMiddleware tuples
    {"type": "input_tokens", "value": 8000}  # Anthropic's context editing

``fraction`` is of the model's context window (the policy's ``context_window``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_serializer,
    model_validator,
)

from .base import PolicyContext
from .transcript import Transcript

TRIGGER_KINDS = ("tokens", "fraction", "messages", "tool_uses")
_ALIASES = {"input_tokens": "tokens", "tool_use": "tool_uses", "message": "messages"}


def _kind_and_value(value: object, kinds: Sequence[str], default: str) -> dict[str, object]:
    """Any accepted form -> ``{kind: value}``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a number or {{kind: value}}, got {value!r}")
    if isinstance(value, int | float | str):
        return {default: value}
    if isinstance(value, list | tuple) and len(value) == 2 and isinstance(value[0], str):
        kind, amount = value
    elif isinstance(value, Mapping) and set(value) == {"type", "value"}:
        kind, amount = value["type"], value["value"]
    elif isinstance(value, Mapping):
        given = {k: v for k, v in value.items() if v is not None}
        if len(given) != 1:
            raise ValueError(f"give exactly one of {', '.join(kinds)}; got {dict(value)!r}")
        ((kind, amount),) = given.items()
    else:
        raise ValueError(f"expected a number, [kind, value] or {{kind: value}}, got {value!r}")
    kind = _ALIASES.get(str(kind), str(kind))
    if kind not in kinds:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(kinds)}")
    return {kind: amount}


class Trigger(BaseModel):
    """One threshold: the policy fires while the transcript is above it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int | None = Field(default=None, gt=0)
    fraction: float | None = Field(default=None, gt=0, le=1)
    messages: int | None = Field(default=None, gt=0)
    tool_uses: int | None = Field(default=None, gt=0)

    @model_validator(mode="before")
    @classmethod
    def _forms(cls, value: Any) -> Any:
        if isinstance(value, Trigger):
            return value
        return _kind_and_value(value, TRIGGER_KINDS, "tokens")

    @model_serializer
    def _dump(self) -> dict[str, object]:
        return {k: v for k in TRIGGER_KINDS if (v := getattr(self, k)) is not None}

    @property
    def kind(self) -> str:
        return next(iter(self._dump()))

    def describe(self) -> str:
        ((kind, value),) = self._dump().items()
        return f"{value} {kind}" if kind != "fraction" else f"{value:g} of the context window"

    def measure(
        self, transcript: Transcript, context: PolicyContext, context_window: int | None
    ) -> tuple[float, float]:
        """(the transcript's size in this trigger's unit, the threshold)."""
        if self.messages is not None:
            return len(transcript), self.messages
        if self.tool_uses is not None:
            return len(transcript.outputs), self.tool_uses
        total = sum(context.tokens(m) for m in transcript.messages)
        if self.tokens is not None:
            return total, self.tokens
        if context_window is None:  # checked when the policy is built
            raise ValueError("a fraction trigger needs context_window")
        assert self.fraction is not None
        return total, self.fraction * context_window

    def reached(
        self, transcript: Transcript, context: PolicyContext, context_window: int | None
    ) -> bool:
        """Whether the transcript is above the threshold (strictly, as LangChain and
        Anthropic count: at the threshold nothing happens yet)."""
        size, threshold = self.measure(transcript, context, context_window)
        return size > threshold


def _count(kind: str) -> BeforeValidator:
    def coerce(value: object) -> object:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return _kind_and_value(value, (kind,), kind)[kind]

    return BeforeValidator(coerce)


ToolUses = Annotated[int, _count("tool_uses"), Field(ge=0)]
"""A number of tool uses: ``3``, ``{"tool_uses": 3}`` or ``{"type": "tool_uses", "value": 3}``."""

Tokens = Annotated[int, _count("tokens"), Field(ge=0)]
"""A number of tokens: ``5000``, ``{"tokens": 5000}`` or ``{"type": "input_tokens", ...}``."""


def check_window(trigger: Trigger, context_window: int | None) -> None:
    """A ``fraction`` trigger needs the window it is a fraction of."""
    if trigger.fraction is not None and context_window is None:
        raise ValueError("a fraction trigger needs context_window (the model's window in tokens)")
