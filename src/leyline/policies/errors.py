"""Typed errors of the policy SDK. Each names the problem and where it is.

They subclass ``ValueError`` where the caller handed in bad data (a config, a transcript), so
code that already catches ``ValueError`` keeps working; ``PolicyError`` catches them all.
"""

from __future__ import annotations

from collections.abc import Sequence


class PolicyError(Exception):
    """Base of every error raised by ``leyline.policies``."""


class PolicyConfigError(PolicyError, ValueError):
    """A policy config (string, dict or keyword arguments) is malformed or has a bad value."""

    def __init__(self, config: str, problem: str) -> None:
        super().__init__(f"policy config {config!r}: {problem}")
        self.config = config
        self.problem = problem


class UnknownPolicyError(PolicyConfigError):
    """A config names a policy that is neither built in nor registered via entry points."""

    def __init__(self, name: str, known: Sequence[str]) -> None:
        super().__init__(
            name, f"no policy named {name!r}; known policies: {', '.join(sorted(known))}"
        )
        self.name = name
        self.known = tuple(sorted(known))


class TranscriptError(PolicyError, ValueError):
    """A message list is not a valid OpenAI-style transcript (e.g. an orphan tool output)."""

    def __init__(self, message_index: int | None, problem: str) -> None:
        where = f"message {message_index}: " if message_index is not None else ""
        super().__init__(f"{where}{problem}")
        self.message_index = message_index
        self.problem = problem


class PolicyEditError(PolicyError):
    """A policy proposed edits that break a rule (pinned message, conflict, out of range)."""

    def __init__(self, policy: str, problem: str) -> None:
        super().__init__(f"policy {policy!r}: {problem}")
        self.policy = policy
        self.problem = problem


class SkillError(PolicyError, ValueError):
    """A skill cannot be registered or used as asked (an unknown name, a server rendering
    that cannot be split per message). Errors the server answers stay ``LeylineError``."""

    def __init__(self, skill: str, problem: str) -> None:
        super().__init__(f"skill {skill!r}: {problem}")
        self.skill = skill
        self.problem = problem


class PinnedSpanError(PolicyError):
    """The server refused a request because it would change a pinned span (``pinned_span``,
    409): an edit of a pinned message (the agent's own rewrite, or another client's), or a
    prompt that diverges from the session before a pin ends. Nothing was changed, on the
    server or in the episode: unpin first, or leave the pinned message as it was."""

    def __init__(self, session: str | None, detail: str, field: str | None = None) -> None:
        super().__init__(f"session {session!r}: pinned span: {detail}")
        self.session = session
        self.detail = detail
        self.field = field
