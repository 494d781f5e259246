"""Replace a range of old turns with a summary the serving model writes.

Condensers elsewhere (OpenHands, mini-swe-agent, LangChain's ``SummarizationMiddleware``)
re-prefill the whole context after the summary; here it goes in as one ``splice`` and the KV
of the turns kept after it stays. On a server without Leyline the summary simply replaces
the messages.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from leyline.protocol import Mode

from .base import EditMode, Policy, PolicyContext, SummaryRequest
from .edits import DropMessages, PolicyEdit, ReplaceMessage
from .errors import PolicyEditError
from .messages import content_text
from .stubs import stub_pattern
from .transcript import Transcript
from .triggers import Trigger, check_window

DEFAULT_PROMPT = (
    "Summarize the conversation above for your own later use: the task, what was done and "
    "found (files, commands, results, errors), decisions made, and what remains to do. Keep "
    "names, paths, numbers and identifiers exactly. Answer with the summary only."
)


class Summarize(Policy):
    """Once the transcript is over ``trigger``, summarise its old turns into one message.

    The range runs from the end of the opening (the messages before the first assistant
    message, or the first ``keep_first`` messages) to the start of the last ``keep_last``
    turns; a summary this policy wrote earlier is part of the range, so summaries fold into
    the next one instead of piling up. A pinned message ends the range early. Nothing
    happens while the range holds fewer than ``min_messages`` messages or no assistant turn.

    The summary is a plain chat completion on the same server (no session: it does not touch
    the episode's cache), asked through the ``summarizer`` of the policy context, which the
    OpenAI-client wrappers provide. Its messages are the conversation up to the end of the
    range, as the policy sees it (earlier stubs included), followed by ``prompt`` as a user
    message: a prefix the server has just served, so a prefix cache serves it too.
    """

    type: Literal["summarize"] = "summarize"
    trigger: Trigger = Field(default_factory=lambda: Trigger(tokens=8000))
    context_window: int | None = Field(default=None, gt=0)
    keep_last: int = Field(default=2, ge=0)
    """Turns (an assistant message and what follows it) kept verbatim at the end."""
    keep_first: int | None = Field(default=None, ge=0)
    """Messages kept at the start; None: the opening (system prompt and task)."""
    min_messages: int = Field(default=2, ge=1)
    prompt: str = DEFAULT_PROMPT
    """The instruction appended (as a user message) to the conversation for the summary."""
    template: str = "[Summary of the earlier conversation]\n{summary}"
    """The summary message's text; ``{summary}`` is the model's answer."""
    role: Literal["user", "system", "developer", "assistant"] = "user"
    max_tokens: int | None = Field(default=512, gt=0)
    """``max_tokens`` of the summary request."""
    temperature: float | None = Field(default=0.0, ge=0)
    mode: EditMode = Mode.amortize

    @field_validator("template")
    @classmethod
    def _has_summary(cls, value: str) -> str:
        try:
            value.format(summary="")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"template may use only {{summary}}: {exc!r}") from None
        if "{summary}" not in value:
            raise ValueError("template must contain {summary}")
        return value

    @model_validator(mode="after")
    def _window(self) -> Summarize:
        check_window(self.trigger, self.context_window)
        return self

    def is_summary(self, text: str | None) -> bool:
        """Whether ``text`` is a summary message this policy writes."""
        if text is None:
            return False
        literal = self.template.replace("{summary}", "\0")
        pattern = stub_pattern(literal.replace("{", "{{").replace("}", "}}").replace("\0", "{s}"))
        return pattern.fullmatch(text) is not None

    def summary_range(self, transcript: Transcript) -> range:
        """The messages the next summary replaces (empty: nothing to summarise)."""
        n = len(transcript)
        start = self.keep_first if self.keep_first is not None else _opening(transcript)
        start = min(start, n)
        earlier = [i for i in range(start) if self._own(transcript, i)]
        if earlier:
            start = earlier[0]  # fold the previous summary into the next one
        while start < n and transcript.role(start) == "tool":
            start += 1  # an output whose call is kept stays with it
        cutoff = transcript.num_turns - self.keep_last
        end = next((i for i in range(start, n) if transcript.turns[i] > cutoff), n)
        end = next((i for i in range(start, end) if i in transcript.pinned), end)
        while end > start and not _closed(transcript, start, end):
            end -= 1  # never split a call from its outputs
        has_turn = any(transcript.role(i) == "assistant" for i in range(start, end))
        if end - start < self.min_messages or not has_turn:
            return range(0)
        return range(start, end)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        if not self.trigger.reached(transcript, context, self.context_window):
            return []
        span = self.summary_range(transcript)
        if not span:
            return []
        if context.summarizer is None:
            raise PolicyEditError(
                self.type,
                "needs a summarizer (the model that writes the summary): run it through "
                "LeylineOpenAI / AsyncLeylineOpenAI, or TurnPlanner(summarizer=...)",
            )
        request = SummaryRequest(
            messages=(*transcript.messages[: span.stop], {"role": "user", "content": self.prompt}),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
        )
        summary = context.summarizer(request).strip()
        if not summary:
            return []
        reason = (
            f"over the trigger ({self.trigger.describe()}): messages {span.start}-"
            f"{span.stop - 1} summarised"
        )
        message = {"role": self.role, "content": self.template.format(summary=summary)}
        edits: list[PolicyEdit] = [ReplaceMessage(span.start, message, self.mode, reason)]
        if len(span) > 1:
            edits.append(DropMessages(tuple(span[1:]), self.mode, reason))
        return edits

    def _own(self, transcript: Transcript, index: int) -> bool:
        message = transcript.messages[index]
        return message.get("role") == self.role and self.is_summary(content_text(message))


def _closed(transcript: Transcript, start: int, end: int) -> bool:
    """Whether ``[start, end)`` holds every call together with its outputs."""
    inside = range(start, end)
    return all((o.message in inside) == (o.call.message in inside) for o in transcript.outputs)


def _opening(transcript: Transcript) -> int:
    """Messages before the first assistant message."""
    return next((i for i in range(len(transcript)) if transcript.turns[i] > 0), len(transcript))
