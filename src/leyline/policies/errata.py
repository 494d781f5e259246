"""Field errata: a field changed inside the cached prefix becomes an appended note.

After "Models Take Notes at Prefill": a model reads its decisions from notes taken
downstream of a field, so an in-place edit of the field is largely ignored, while an
appended ``[STATE UPDATE] field -> value; overrides the earlier value.`` is read, and the
cached prefix stays byte-identical (every prefix cache keeps hitting).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import field_validator

from leyline.protocol import ErratumDirective

from .align import align_messages
from .base import Policy, PolicyContext, regex_option
from .edits import AppendErratum, KeepServed, PolicyEdit
from .messages import content_text, same_rendering
from .transcript import Transcript

NOTE = re.compile(
    r"^\[STATE UPDATE\] (?P<field>.+?) -> (?P<value>.*); overrides the earlier value\.$"
)


def note(field: str, value: str) -> str:
    """The canonical note, as :meth:`ErratumDirective.for_field` writes it."""
    return str(ErratumDirective.for_field(field, value).text).strip()


class FieldErrata(Policy):
    """Keep cached messages as served; append a note for each field the agent changed.

    A cached message (one of ``context.served``) counts as a field change when its new text
    differs from the served one only in lines matching ``field_pattern`` (groups ``field``
    and ``value``; default ``name: value`` or ``name = value``) with the same field names.
    Then the message is sent with its served text (:class:`KeepServed`) and a note is
    appended; any other change is left alone (it becomes a splice). A field set back to its
    served value after a note overrode it gets a note too. Field names are global: the
    latest note for a name wins, so a note is written only when it changes what the notes
    already say.
    """

    type: Literal["errata"] = "errata"
    field_pattern: str = r"^\s*(?P<field>[A-Za-z_][\w.\- ]*?)\s*[:=]\s*(?P<value>.*?)\s*$"
    fields: tuple[str, ...] = ()
    """Only these fields (empty: any line that matches ``field_pattern``)."""
    roles: tuple[str, ...] = ("system", "developer", "user")
    note_role: str = "user"

    @field_validator("field_pattern")
    @classmethod
    def _has_groups(cls, value: str) -> str:
        groups = regex_option(value, "field_pattern is not a valid regex: {exc}").groupindex
        if not {"field", "value"} <= set(groups):
            raise ValueError("field_pattern needs the named groups 'field' and 'value'")
        return value

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        if not context.served:
            return []
        noted = _noted_values(transcript)
        edits: list[PolicyEdit] = []
        for old_index, index in align_messages(context.served, transcript.messages):
            if old_index is None or index is None or index in transcript.pinned:
                continue
            served, message = context.served[old_index], transcript.messages[index]
            if message.get("role") not in self.roles:
                continue
            old_text, new_text = content_text(served), content_text(message)
            if old_text is None or new_text is None:
                continue
            if same_rendering(served, message):
                changes = self._drift(old_text, noted)
            else:
                found = self._changes(old_text, new_text)
                if found is None:
                    continue  # not a pure field change: a splice will carry it
                changes = found
                edits.append(KeepServed(index, old_text, reason="keep the cached prefix"))
            notes = []
            for field, value in changes:
                if noted.get(field) != value:
                    notes.append(note(field, value))
                    noted[field] = value
            if notes:
                edits.append(AppendErratum("\n".join(notes), corrects=index, role=self.note_role))
        return edits

    def _fields(self, text: str) -> list[tuple[str, str] | None]:
        out: list[tuple[str, str] | None] = []
        for line in text.split("\n"):
            match = re.match(self.field_pattern, line)
            field = match["field"] if match else None
            if match and field and (not self.fields or field in self.fields):
                out.append((field, match["value"]))
            else:
                out.append(None)
        return out

    def _changes(self, old: str, new: str) -> list[tuple[str, str]] | None:
        """``(field, new value)`` for each changed line, or None if any change is not one."""
        old_lines, new_lines = old.split("\n"), new.split("\n")
        if len(old_lines) != len(new_lines):
            return None
        old_fields, new_fields = self._fields(old), self._fields(new)
        changes: list[tuple[str, str]] = []
        for k, (a, b) in enumerate(zip(old_lines, new_lines, strict=True)):
            if a == b:
                continue
            before, after = old_fields[k], new_fields[k]
            if before is None or after is None or before[0] != after[0]:
                return None
            changes.append(after)
        return changes or None

    def _drift(self, text: str, noted: dict[str, str]) -> list[tuple[str, str]]:
        """Fields of an unchanged message that notes overrode and the agent set back."""
        return [f for f in self._fields(text) if f is not None and f[0] in noted]


def _noted_values(transcript: Transcript) -> dict[str, str]:
    values: dict[str, str] = {}
    for index in range(len(transcript)):
        for line in (transcript.text(index) or "").split("\n"):
            match = NOTE.match(line)
            if match:
                values[match["field"]] = match["value"]
    return values
