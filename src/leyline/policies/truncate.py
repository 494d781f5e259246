"""The paper's rule: keep the tool outputs of the last ``keep_last`` tool turns, stub the rest."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext
from .edits import PolicyEdit
from .stubs import StubTemplate, decay_marks, stub_edit
from .transcript import Transcript


class TruncateOldToolOutputs(Policy):
    """Stub every tool output older than the last ``keep_last`` turns that called tools.

    Parallel calls of one assistant message are one turn. With ``keep_last=2`` (the paper's
    n = 2) only the two most recent tool turns keep their outputs verbatim.
    """

    type: Literal["truncate"] = "truncate"
    keep_last: int = Field(default=2, ge=0)
    stub: StubTemplate = "[evicted: {tool} output from turn {turn}]"
    exclude_tools: tuple[str, ...] = ()
    """Tools whose outputs are never stubbed (e.g. a memory or plan tool)."""
    mode: EditMode = Mode.amortize
    decay: bool = False
    """Where the server executes ``decay``: mark the old outputs ``decay`` (the stub as the
    replacement, older turns dropped first) instead of stubbing them now."""

    def stub_templates(self) -> tuple[str, ...]:
        return (self.stub,)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        turns = transcript.tool_turns()
        kept = set(turns[len(turns) - self.keep_last :]) if self.keep_last else set()
        edits: list[PolicyEdit] = []
        reason = f"older than the last {self.keep_last} tool turns"
        old = [
            o
            for o in transcript.outputs
            if o.call.turn not in kept and o.call.name not in self.exclude_tools
        ]
        if self.decay and context.retention:
            return decay_marks(transcript, old, self.stub, self.mode, reason, context.is_stub)
        for output in old:
            edit = stub_edit(transcript, output, self.stub, self.mode, reason, context.is_stub)
            if edit is not None:
                edits.append(edit)
        return edits
