"""Retention policies: pin messages (:class:`Pin`), and drop reasoning once its turn is
over (:class:`ScratchReasoning`).

Neither does I/O. On a Leyline server the planner sends their pins and ``scratch`` marks as
directives (the server then refuses edits of a pinned message and drops marked reasoning
itself); elsewhere a pin only constrains the policies and reasoning is removed by an edit,
once, and stays removed byte for byte.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

from pydantic import Field, field_validator

from leyline.protocol import Mode
from leyline.protocol.directives import MAX_PIN_TTL_S

from .base import EditMode, Policy, PolicyContext, regex_option
from .edits import MarkSpan, PolicyEdit, ReplaceContent, ReplaceMessage
from .messages import Message, message_key, with_content
from .transcript import Transcript

PinPredicate = Callable[[int, Message], bool]
"""``predicate(index, message)``: whether message ``index`` of the transcript is pinned."""


class Pin(Policy):
    """Pin messages: by ``roles`` (``["system"]``), by ``tools`` (the outputs of those
    tools), by ``messages`` (indices; negative ones count from the end) or by ``predicate``
    (in code only, not in a config string). ``ttl_s`` goes with the ``pin`` directives.
    Proposes no edits: no policy may edit a pinned message (``run_policy`` refuses it), and
    on a Leyline server the planner pins it once it is in the session, so the server refuses
    edits of it too (``pinned_span``) and evicts its session last."""

    type: Literal["pin"] = "pin"
    roles: tuple[str, ...] = ()
    tools: tuple[str, ...] = ()
    messages: tuple[int, ...] = ()
    ttl_s: float | None = Field(default=None, gt=0.0, le=MAX_PIN_TTL_S)
    predicate: PinPredicate | None = Field(default=None, exclude=True)

    def pins(self, transcript: Transcript) -> frozenset[int]:
        n = len(transcript)
        out = {i if i >= 0 else n + i for i in self.messages if -n <= i < n}
        out |= {i for i, m in enumerate(transcript.messages) if m.get("role") in self.roles}
        out |= {o.message for o in transcript.outputs if o.call.name in self.tools}
        if self.predicate is not None:
            predicate = self.predicate
            out |= {i for i, m in enumerate(transcript.messages) if predicate(i, m)}
        return frozenset(out)

    def pin_ttl_s(self) -> float | None:
        return self.ttl_s

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return []


DEFAULT_THINKING = r"<think>.*?</think>\s*"


class ScratchReasoning(Policy):
    """Drop the reasoning of every assistant message but the last ``keep``.

    * ``pattern``: a regex for the thinking blocks inside an assistant message's text
      content (default ``<think>...</think>`` and the whitespace after it);
    * ``reasoning_field``: a message field holding the reasoning (default
      ``reasoning_content``), removed with the message replaced whole; None: not looked at;
    * ``mode``: how the drop is executed (``amortize`` keeps the downstream KV).

    On a Leyline server with retention, a thinking block in the content of a message the
    server holds becomes a ``scratch`` mark over the content, whose replacement is the
    content without its thinking blocks: visible to the generation of the request that
    carries the mark, dropped by the server after it. Otherwise (plain servers, a message
    not cached yet, a reasoning field) the reasoning is removed by an edit.
    """

    type: Literal["scratch"] = "scratch"
    keep: int = Field(default=1, ge=0)
    pattern: str = DEFAULT_THINKING
    reasoning_field: str | None = "reasoning_content"
    mode: EditMode = Mode.amortize

    @field_validator("pattern")
    @classmethod
    def _regex(cls, value: str) -> str:
        regex_option(value, "invalid regex {value!r}: {exc}")
        if not value:
            raise ValueError("the pattern must not be empty")
        return value

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        messages = transcript.messages
        replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
        old = replies[: max(0, len(replies) - self.keep)]
        served = {message_key(m) for m in context.served} if context.retention else set()
        pattern = re.compile(self.pattern, re.DOTALL)
        edits: list[PolicyEdit] = []
        reason = f"reasoning older than the last {self.keep} replies"
        for index in old:
            if index in transcript.pinned:
                continue
            message = messages[index]
            content = message.get("content")
            text = pattern.sub("", content) if isinstance(content, str) else content
            has_field = self.reasoning_field is not None and self.reasoning_field in message
            if text == content and not has_field:
                continue
            if has_field:
                whole = {k: v for k, v in message.items() if k != self.reasoning_field}
                if text != content:
                    whole["content"] = text
                edits.append(ReplaceMessage(index, whole, self.mode, reason))
            elif message_key(message) in served:
                assert isinstance(text, str)
                edits.append(MarkSpan(index, "scratch", text, mode=self.mode, reason=reason))
            else:
                assert isinstance(text, str)
                edits.append(ReplaceContent(index, text, self.mode, reason))
        return edits


def strip_reasoning(message: Message, pattern: str = DEFAULT_THINKING) -> dict[str, object]:
    """``message`` without its thinking blocks (a helper for agents and tests)."""
    content = message.get("content")
    if not isinstance(content, str):
        return dict(message)
    return with_content(message, re.sub(pattern, "", content, flags=re.DOTALL))
