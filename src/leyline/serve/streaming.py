"""Server-sent events for streamed completions: text deltas that never need taking back."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from pydantic import BaseModel


def sse(event: BaseModel | str) -> str:
    data = event if isinstance(event, str) else event.model_dump_json(exclude_none=True)
    return f"data: {data}\n\n"


DONE = sse("[DONE]")


class DeltaText:
    """Turns a growing token list into text deltas.

    Holds back what could still become a stop string (it would be cut from the final text)
    and a trailing partial UTF-8 character (decoded as U+FFFD until complete).
    """

    def __init__(
        self, decode: Callable[[Sequence[int]], str], stops: Sequence[str], hidden: Collection[int]
    ) -> None:
        self._decode = decode
        self._holdback = max((len(s) for s in stops), default=1) - 1
        self._hidden = frozenset(hidden)
        self._tokens: list[int] = []
        self.sent = ""

    def push(self, token: int) -> str:
        if token in self._hidden:
            return ""
        self._tokens.append(token)
        text = self._decode(self._tokens)
        safe = len(text) - self._holdback
        while safe > len(self.sent) and text[safe - 1] == "\ufffd":
            safe -= 1
        if safe <= len(self.sent):
            return ""
        delta, self.sent = text[len(self.sent) : safe], text[:safe]
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of ``final_text`` (the generation's authoritative text)."""
        if not final_text.startswith(self.sent):
            return ""  # already-sent text cannot be taken back; the final text disagrees
        delta, self.sent = final_text[len(self.sent) :], final_text
        return delta
