"""Stale tool outputs: superseded by a later identical call, or a file view made stale by an
edit of that file later on."""

from __future__ import annotations

import posixpath
from typing import Literal

from pydantic import Field

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext
from .edits import PolicyEdit
from .stubs import StubTemplate, stub_edit
from .transcript import ToolCall, ToolOutput, Transcript


class StaleToolOutputs(Policy):
    """Stub outputs that a later call made stale.

    * superseded: a later call of the same tool with the same arguments (key order and
      spacing ignored) has answered, so the earlier answer is outdated or redundant;
    * file views: a call of a ``view_tools`` tool on a path, followed by a call of an
      ``edit_tools`` tool on the same path (each maps a tool to its path argument).
    """

    type: Literal["stale"] = "stale"
    superseded: bool = True
    view_tools: dict[str, str] = Field(
        default_factory=lambda: {"view": "path", "read_file": "path", "open_file": "path"}
    )
    edit_tools: dict[str, str] = Field(
        default_factory=lambda: {"rewrite": "path", "edit": "path", "write_file": "path"}
    )
    stub: StubTemplate = "[stale: {tool} output superseded by a later identical call]"
    file_stub: StubTemplate = "[stale: {tool} output of a file edited later]"
    mode: EditMode = Mode.amortize

    def stub_templates(self) -> tuple[str, ...]:
        return (self.stub, self.file_stub)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        answered = [o.call for o in transcript.outputs]
        edits: list[PolicyEdit] = []
        for output in transcript.outputs:
            template, reason = self._staleness(output, answered)
            if template is None:
                continue
            edit = stub_edit(transcript, output, template, self.mode, reason, context.is_stub)
            if edit is not None:
                edits.append(edit)
        return edits

    def _staleness(self, output: ToolOutput, answered: list[ToolCall]) -> tuple[str | None, str]:
        call = output.call
        later = [c for c in answered if c.message > call.message]
        if self.superseded and any(
            c.name == call.name and c.arguments_key() == call.arguments_key() for c in later
        ):
            return self.stub, f"superseded by a later {call.name} call with the same arguments"
        path = _path(call, self.view_tools)
        if path is not None and any(_path(c, self.edit_tools) == path for c in later):
            return self.file_stub, f"{path} was edited after this view"
        return None, ""


def _path(call: ToolCall, tools: dict[str, str]) -> str | None:
    argument = tools.get(call.name)
    value = call.argument(argument) if argument else None
    if not isinstance(value, str) or not value:
        return None
    return posixpath.normpath(value.replace("\\", "/"))
