"""The policy contract: a small pure pydantic object, transcript in, edits out.

A policy is its own config: ``TruncateOldToolOutputs(keep_last=2)``, the dict
``{"type": "truncate", "keep_last": 2}`` and the string ``truncate:keep_last=2`` are the
same object (see :mod:`.registry`). :func:`run_policy` is the one way to run one: it builds
the context and checks what comes back.
"""

from __future__ import annotations

import re
from abc import abstractmethod
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict

from leyline.protocol import Mode

from .counting import TokenCounter, default_counter, message_tokens
from .edits import AppendErratum, MarkSpan, PolicyEdit, apply_to_messages, check_edits, touched
from .errors import PolicyEditError, TranscriptError
from .messages import Message
from .stubs import StubMatcher
from .transcript import Transcript


def _mode_alias(value: object) -> object:
    return Mode.amortize if value == "splice" else value


EditMode = Annotated[Mode, BeforeValidator(_mode_alias)]
"""``amortize`` (alias ``splice``, the default) or ``forget``."""


def regex_option(value: str, refusal: str) -> re.Pattern[str]:
    """A policy option's regex, compiled. Raises ``ValueError(refusal)`` for one that does
    not compile, ``{value}`` and ``{exc}`` formatted in (a pydantic validator's error)."""
    try:
        return re.compile(value)
    except re.error as exc:
        raise ValueError(refusal.format(value=value, exc=exc)) from None


@dataclass(frozen=True, slots=True)
class SummaryRequest:
    """A chat completion a policy asks the serving model for (a summary of old turns)."""

    messages: tuple[Message, ...]
    """The request's messages: the conversation to summarise, then the instruction."""
    max_tokens: int | None = None
    temperature: float | None = None


Summarizer = Callable[[SummaryRequest], str]
"""Sends a :class:`SummaryRequest` as a plain chat completion and returns the reply's text.
The OpenAI-client wrappers provide one that calls the wrapped client (same server, same
model, outside the episode's session)."""


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy may look at besides the transcript."""

    counter: TokenCounter | None = None
    """Counts tokens; None means :func:`~.counting.default_counter` on first use."""
    served: tuple[Message, ...] = ()
    """The messages of the server's cached revision (empty when nothing is cached)."""
    is_stub: StubMatcher = field(default_factory=StubMatcher)
    """Recognises stubs of every policy in play, so none is stubbed twice."""
    summarizer: Summarizer | None = None
    """Asks the model for a summary (:class:`~.summarize.Summarize`); None: none available."""
    retention: bool = False
    """The server executes ``decay`` and ``scratch`` marks (a Leyline server that lists them
    among its verbs, with a session cached): policies may propose :class:`~.edits.MarkSpan`
    instead of clearing. False: clear with edits."""

    def tokens(self, message: Message) -> int:
        return message_tokens(self.counter or default_counter(), message)

    def count(self, text: str) -> int:
        return (self.counter or default_counter()).count(text)


class Policy(BaseModel):
    """Base of every policy. Subclasses set ``type: Literal["name"] = "name"``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str

    @abstractmethod
    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        """Edits to make now; ``[]`` when there is nothing to do.

        Must be pure, must skip pinned messages and stubs (``context.is_stub``), and must
        return ``[]`` when run again on its own result (an applied edit never re-fires).
        """

    def stub_templates(self) -> tuple[str, ...]:
        """Templates of the stubs this policy writes, so every policy can recognise them."""
        return ()

    def pins(self, transcript: Transcript) -> frozenset[int]:
        """Messages of ``transcript`` this policy pins: no policy may edit them, and on a
        Leyline server they are sent as ``pin`` directives (see :class:`~.retention.Pin`)."""
        return frozenset()

    def pin_ttl_s(self) -> float | None:
        """The ``ttl_s`` of the ``pin`` directives for this policy's pins (None: none)."""
        return None


def run_policy(
    policy: Policy,
    transcript: Transcript | Sequence[Message],
    *,
    counter: TokenCounter | None = None,
    served: Sequence[Message] = (),
    pinned: Collection[int] = (),
    stub_templates: Sequence[str] = (),
    summarizer: Summarizer | None = None,
    retention: bool = False,
) -> list[PolicyEdit]:
    """Run ``policy`` on a transcript (or a message list) and check its edits.

    Raises:
        TranscriptError: the messages are not a valid transcript.
        PolicyEditError: the policy edited a pinned message, changed one message twice,
            addressed a message that does not exist, or left an invalid transcript.
    """
    if not isinstance(transcript, Transcript):
        transcript = Transcript.from_messages(transcript, pinned=pinned)
    elif pinned:
        transcript = Transcript.from_messages(
            transcript.messages, pinned=transcript.pinned | set(pinned)
        )
    own = policy.pins(transcript) - transcript.pinned
    if own:
        transcript = Transcript.from_messages(transcript.messages, pinned=transcript.pinned | own)
    context = PolicyContext(
        counter=counter,
        served=tuple(served),
        is_stub=StubMatcher.of([*policy.stub_templates(), *stub_templates]),
        summarizer=summarizer,
        retention=retention,
    )
    edits = policy.propose(transcript, context)
    check_result(policy.type, transcript, edits)
    return edits


def check_result(name: str, transcript: Transcript, edits: Sequence[PolicyEdit]) -> None:
    """The checks of :func:`run_policy`, for combinators that run policies themselves."""
    check_edits(name, len(transcript), edits)
    for k, edit in enumerate(edits):
        hit = sorted(set(touched(edit)) & transcript.pinned)
        if isinstance(edit, MarkSpan) and edit.message in transcript.pinned:
            hit = [edit.message]
        corrects = edit.corrects if isinstance(edit, AppendErratum) else None
        if corrects is not None and not 0 <= corrects < len(transcript):
            raise PolicyEditError(
                name,
                f"edit {k} corrects message {corrects}, outside the {len(transcript)} messages",
            )
        if hit:
            raise PolicyEditError(name, f"edit {k} changes pinned message(s) {hit}")
    try:
        Transcript.from_messages(apply_to_messages(transcript.messages, edits).messages)
    except TranscriptError as exc:
        raise PolicyEditError(name, f"its edits leave an invalid transcript: {exc}") from None
