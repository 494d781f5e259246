"""A token budget with hysteresis: edit rarely, and then in one batch.

Nothing happens while the transcript fits in ``max_tokens``. Once it exceeds it, the oldest
tool outputs are stubbed, in one batch, until it fits in ``target_tokens``; so the next edit
comes only after ``max_tokens - target_tokens`` more tokens, not every turn.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext
from .edits import PolicyEdit, ReplaceContent
from .stubs import StubTemplate, render_stub
from .transcript import Transcript


class TokenBudget(Policy):
    """Keep the transcript under ``max_tokens`` by stubbing the oldest tool outputs.

    An output is stubbed only if that saves at least ``min_saving`` tokens; outputs of the
    last ``keep_last`` tool turns are left alone. Tokens are counted with the context's
    counter (the server's tokenizer, tiktoken, or the estimate; see :mod:`.counting`).
    """

    type: Literal["budget"] = "budget"
    max_tokens: int = Field(gt=0)
    target_tokens: int = Field(gt=0)
    min_saving: int = Field(default=64, ge=1)
    keep_last: int = Field(default=1, ge=0)
    exclude_tools: tuple[str, ...] = ()
    stub: StubTemplate = "[evicted to fit the token budget: {tool} output from turn {turn}]"
    mode: EditMode = Mode.amortize

    @model_validator(mode="after")
    def _target_below_max(self) -> TokenBudget:
        if self.target_tokens >= self.max_tokens:
            raise ValueError(
                f"target_tokens ({self.target_tokens}) must be below max_tokens "
                f"({self.max_tokens}): the gap is what keeps edits from firing every turn"
            )
        return self

    def stub_templates(self) -> tuple[str, ...]:
        return (self.stub,)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        total = sum(context.tokens(m) for m in transcript.messages)
        if total <= self.max_tokens:
            return []
        turns = transcript.tool_turns()
        recent = set(turns[len(turns) - self.keep_last :]) if self.keep_last else set()
        excess = total - self.target_tokens
        edits: list[PolicyEdit] = []
        for output in transcript.outputs:  # oldest first
            if excess <= 0:
                break
            if (
                output.call.turn in recent
                or output.call.name in self.exclude_tools
                or output.message in transcript.pinned
                or context.is_stub(output.text)
            ):
                continue
            stub = render_stub(self.stub, output)
            saving = context.count(output.text) - context.count(stub)
            if saving < self.min_saving:
                continue
            reason = f"{total} tokens exceed the budget of {self.max_tokens}"
            edits.append(ReplaceContent(output.message, stub, self.mode, reason))
            excess -= saving
        return edits
