"""Clear old tool uses once the context is over a trigger: Anthropic's ``clear_tool_uses``
context edit and LangChain's ``ClearToolUsesEdit``, with their knobs, as cache edits.

Where those re-prefill everything after the first cleared result, here each clear is a
``splice`` of the output (and, with ``clear_tool_inputs``, of the call's arguments) and the
downstream KV stays. On a server without Leyline the same edits go as messages; the policy
then clears in batches (everything eligible at once, only when the trigger is crossed, and
not at all when the batch would free less than ``clear_at_least``), and every placeholder
is rendered once and kept byte for byte, so the server's prefix cache hits between clears.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from pydantic import Field, model_validator

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext
from .edits import PolicyEdit, ReplaceContent, ReplaceMessage
from .messages import Message
from .stubs import StubTemplate, decay_marks, render_stub, stub_edit
from .transcript import ToolCall, Transcript
from .triggers import Tokens, ToolUses, Trigger, check_window

CLEARED_ARGUMENTS = "{}"
"""What a cleared call's ``function.arguments`` becomes (valid JSON for every template)."""


class ClearToolUses(Policy):
    """Once the transcript is over ``trigger``, clear every tool use but the last ``keep``.

    * ``trigger``: tokens (default 100,000), a ``fraction`` of ``context_window``, a number of
      ``messages`` or of ``tool_uses`` (see :mod:`.triggers` for the accepted forms);
    * ``keep``: the most recent tool uses (answered calls, parallel ones counted one by one)
      whose outputs stay;
    * ``clear_at_least``: tokens; when clearing every eligible use frees fewer, nothing is
      cleared (a cache edit that saves little is not worth making);
    * ``exclude_tools``: tools whose uses are never cleared;
    * ``clear_tool_inputs``: also blank the arguments of the cleared calls (``{}``); True for
      every tool, or a list of tool names;
    * ``placeholder``: the text left in place of an output (a stub template: ``{tool}``,
      ``{call_id}``, ``{turn}``, ``{chars}``, ``{lines}``);
    * ``decay``: on a server that executes ``decay``, mark the outputs instead of clearing
      them (no ``clear_at_least``, no input clearing: marks cost nothing and the server
      drops only what it must).

    Outputs already cleared (by this or any policy in play), pinned messages, and outputs no
    longer than their placeholder are skipped. Tokens are counted with the context's counter.
    """

    type: Literal["clear_tool_uses"] = "clear_tool_uses"
    trigger: Trigger = Field(default_factory=lambda: Trigger(tokens=100_000))
    context_window: int | None = Field(default=None, gt=0)
    """The model's context window in tokens, for a ``fraction`` trigger."""
    keep: ToolUses = 3
    clear_at_least: Tokens = 0
    exclude_tools: tuple[str, ...] = ()
    clear_tool_inputs: bool | tuple[str, ...] = False
    placeholder: StubTemplate = "[cleared]"
    mode: EditMode = Mode.amortize
    decay: bool = False
    """Where the server executes ``decay``: mark the outputs it would clear ``decay`` (the
    placeholder as the replacement, priority the call's turn: older dropped first, ``mode``
    as the drop's mode) and let the server drop them under memory pressure instead of
    clearing them now. Elsewhere it clears as without it."""

    @model_validator(mode="after")
    def _window(self) -> ClearToolUses:
        check_window(self.trigger, self.context_window)
        return self

    def stub_templates(self) -> tuple[str, ...]:
        return (self.placeholder,)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        if not self.trigger.reached(transcript, context, self.context_window):
            return []
        outputs = transcript.outputs
        eligible = outputs[: max(0, len(outputs) - self.keep)]
        reason = f"over the trigger ({self.trigger.describe()}), older than the last {self.keep}"
        if self.decay and context.retention:
            return decay_marks(
                transcript,
                [o for o in eligible if o.call.name not in self.exclude_tools],
                self.placeholder,
                self.mode,
                reason,
                context.is_stub,
            )
        edits: list[PolicyEdit] = []
        freed = 0
        inputs: dict[int, set[str]] = {}
        for output in eligible:
            if output.call.name in self.exclude_tools:
                continue
            edit = stub_edit(
                transcript, output, self.placeholder, self.mode, reason, context.is_stub
            )
            if edit is not None:
                stub = render_stub(self.placeholder, output)
                freed += context.count(output.text) - context.count(stub)
                edits.append(edit)
            cleared = edit is not None or context.is_stub(output.text)
            if cleared and self._clears_input(output.call, transcript):
                inputs.setdefault(output.call.message, set()).add(output.call.id)
        for index, ids in sorted(inputs.items()):
            old = transcript.messages[index]
            new = _without_arguments(old, ids)
            freed += context.tokens(old) - context.tokens(new)
            edits.append(ReplaceMessage(index, new, self.mode, f"{reason}: arguments cleared"))
        if not edits or freed < self.clear_at_least:
            return []
        return sorted(edits, key=_position)

    def _clears_input(self, call: ToolCall, transcript: Transcript) -> bool:
        wanted = self.clear_tool_inputs
        if wanted is False or (wanted is not True and call.name not in wanted):
            return False
        if call.message in transcript.pinned:
            return False
        return call.arguments.strip() not in ("", CLEARED_ARGUMENTS)


def _without_arguments(message: Message, ids: set[str]) -> dict[str, object]:
    """A copy of the assistant ``message`` whose calls ``ids`` have their arguments blanked."""
    calls: list[object] = []
    for call in message.get("tool_calls") or []:  # type: ignore[attr-defined]
        if isinstance(call, Mapping) and call.get("id") in ids:
            function = call.get("function")
            function = dict(function) if isinstance(function, Mapping) else {}
            calls.append({**call, "function": {**function, "arguments": CLEARED_ARGUMENTS}})
        else:
            calls.append(call)
    return {**message, "tool_calls": calls}


def _position(edit: PolicyEdit) -> int:
    return edit.message if isinstance(edit, ReplaceContent | ReplaceMessage) else -1
