"""Stub templates: the short text left in place of an evicted tool output.

A stub must be recognisable, or a policy would stub its own stub again next turn and every
trim would re-fire (the complaint about today's trimmers). A template such as
``[evicted: {tool} output from turn {turn}]`` compiles to a pattern that matches every text
it can render, so policies skip outputs that already are a stub of any policy in play.
"""

from __future__ import annotations

import re
import string
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Annotated

from pydantic import AfterValidator

from leyline.protocol import Mode

from .edits import MarkSpan, PolicyEdit, ReplaceContent
from .transcript import ToolOutput, Transcript

STUB_FIELDS = ("tool", "call_id", "turn", "chars", "lines")
"""Fields a stub template may use: the tool's name, the call id, the call's turn, and the
size of the evicted output in characters and lines."""


def check_template(template: str) -> str:
    """Return ``template`` if it is a valid stub template, else raise ``ValueError``."""
    if not template.strip():
        raise ValueError("a stub template must not be empty")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ValueError(f"malformed stub template {template!r}: {exc}") from None
    for field in fields:
        if field not in STUB_FIELDS:
            raise ValueError(
                f"stub template field {{{field}}} is unknown; use {', '.join(STUB_FIELDS)}"
            )
    return template


StubTemplate = Annotated[str, AfterValidator(check_template)]
"""A config field holding a stub template, validated when the policy is built."""


def render_stub(template: str, output: ToolOutput) -> str:
    return template.format(
        tool=output.call.name,
        call_id=output.call.id,
        turn=output.call.turn,
        chars=len(output.text),
        lines=output.text.count("\n") + 1 if output.text else 0,
    )


def stub_pattern(template: str) -> re.Pattern[str]:
    """A pattern matching exactly the texts ``template`` renders (fields match anything)."""
    parts: list[str] = []
    for literal, field, _, _ in string.Formatter().parse(template):
        parts.append(re.escape(literal))
        if field is not None:
            parts.append(".*?")
    return re.compile("".join(parts), re.DOTALL)


@dataclass(frozen=True, slots=True)
class StubMatcher:
    """Recognises stubs of any of a set of templates."""

    patterns: tuple[re.Pattern[str], ...] = ()

    @classmethod
    def of(cls, templates: Iterable[str]) -> StubMatcher:
        unique = dict.fromkeys(templates)  # keep order, drop duplicates
        return cls(tuple(stub_pattern(t.strip()) for t in unique))

    def __call__(self, text: str | None) -> bool:
        return text is not None and any(p.fullmatch(text.strip()) for p in self.patterns)


def stub_edit(
    transcript: Transcript,
    output: ToolOutput,
    template: str,
    mode: Mode,
    reason: str,
    is_stub: StubMatcher,
) -> ReplaceContent | None:
    """Stub ``output`` unless it is pinned, already a stub, or no longer than its stub."""
    if output.message in transcript.pinned or is_stub(output.text):
        return None
    stub = render_stub(template, output)
    if len(stub) >= len(output.text):
        return None
    return ReplaceContent(output.message, stub, mode, reason)


def decay_marks(
    transcript: Transcript,
    outputs: Sequence[ToolOutput],
    template: str,
    mode: Mode,
    reason: str,
    is_stub: StubMatcher,
) -> list[PolicyEdit]:
    """``decay`` marks for ``outputs`` (those :func:`stub_edit` would stub), the stub as the
    replacement and the call's turn as the priority (older outputs are dropped first)."""
    marks: list[PolicyEdit] = []
    for output in outputs:
        edit = stub_edit(transcript, output, template, mode, reason, is_stub)
        if edit is not None:
            marks.append(
                MarkSpan(
                    output.message,
                    "decay",
                    edit.text,
                    priority=output.call.turn,
                    mode=mode,
                    reason=f"{reason}: decays",
                )
            )
    return marks
