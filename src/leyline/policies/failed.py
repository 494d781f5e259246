"""Failed attempts: a tool call that failed and was later retried successfully."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext, regex_option
from .edits import DropMessages, PolicyEdit
from .stubs import StubTemplate, stub_edit
from .transcript import ToolOutput, Transcript

DEFAULT_FAILURE = (
    r"(?im)^\s*(error\b|traceback \(most recent call last\)|exception\b|fatal\b|failed\b"
    r"|[\w.]*(error|exception):)"
)
"""A line that starts like an error report; override ``failure_pattern`` for your tools."""


class FailedAttempts(Policy):
    """Remove tool calls that failed and were retried successfully later.

    A call failed when its output matches ``failure_pattern`` (searched line by line). It
    was retried when a later call of the same tool (with the same arguments if
    ``same_arguments``) succeeded. If every call of an assistant message failed and was
    retried, ``action="drop"`` removes that message and its outputs; otherwise (or with
    ``action="stub"``) each such output is replaced by a stub.
    """

    type: Literal["failed"] = "failed"
    failure_pattern: str = DEFAULT_FAILURE
    same_arguments: bool = False
    action: Literal["drop", "stub"] = "drop"
    stub: StubTemplate = "[failed attempt: {tool} call retried successfully later]"
    mode: EditMode = Mode.amortize
    keep_last: int = Field(default=0, ge=0)
    """Leave failures of the last ``keep_last`` tool turns alone."""

    @field_validator("failure_pattern")
    @classmethod
    def _compiles(cls, value: str) -> str:
        regex_option(value, "failure_pattern is not a valid regex: {exc}")
        return value

    def stub_templates(self) -> tuple[str, ...]:
        return (self.stub,)

    def failed(self, output: ToolOutput) -> bool:
        return re.search(self.failure_pattern, output.text) is not None

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        turns = transcript.tool_turns()
        recent = set(turns[len(turns) - self.keep_last :]) if self.keep_last else set()
        retried = [
            o
            for o in transcript.outputs
            if o.call.turn not in recent and self._retried(transcript, context, o)
        ]
        edits: list[PolicyEdit] = []
        by_message: dict[int, list[ToolOutput]] = {}
        for output in retried:
            by_message.setdefault(output.call.message, []).append(output)
        for message, outputs in by_message.items():
            calls = transcript.calls_of(message)
            whole = [message, *(o.message for o in outputs)]
            if (
                self.action == "drop"
                and len(outputs) == len(calls)
                and not transcript.pinned.intersection(whole)
            ):
                reason = f"{len(calls)} failed call(s) retried successfully later"
                edits.append(DropMessages(tuple(sorted(whole)), self.mode, reason))
                continue
            for output in outputs:
                edit = stub_edit(
                    transcript,
                    output,
                    self.stub,
                    self.mode,
                    "retried successfully later",
                    context.is_stub,
                )
                if edit is not None:
                    edits.append(edit)
        return edits

    def _retried(self, transcript: Transcript, context: PolicyContext, output: ToolOutput) -> bool:
        # A stub says nothing about success either way, so stubs neither fail nor retry.
        if context.is_stub(output.text) or not self.failed(output):
            return False
        call = output.call
        return any(
            later.call.name == call.name
            and later.call.message > call.message
            and (not self.same_arguments or later.call.arguments_key() == call.arguments_key())
            and not context.is_stub(later.text)
            and not self.failed(later)
            for later in transcript.outputs
        )
