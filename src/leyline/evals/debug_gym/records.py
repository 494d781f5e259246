"""What one model call and one episode leave behind (plain data, JSON-ready)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Literal

StopReason = Literal["resolved", "submitted", "max_steps", "error"]


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One chat request of an episode, as sent and as answered."""

    prompt_tokens: int | None
    """The server's ``usage.prompt_tokens`` (None when it reported no usage)."""
    completion_tokens: int | None
    messages: int
    """Messages sent (after the policy's edits)."""
    policy_edits: int
    """Edits the policy proposed this turn."""
    directives: int
    """Leyline directives sent (splice arm on a Leyline server only)."""
    fallback: str | None = None
    """Why the planner sent edits as plain messages although a session was open."""
    path: str | None = None
    """``splice`` / ``reprefill`` / ``prefix_hit``: the server's ``leyline.path``, if any."""
    reused_tokens: int | None = None
    prefilled_tokens: int | None = None
    rotated_tokens: int | None = None
    session_dropped: bool = False
    """The server refused the directives (lost session, stale revision): re-sent plain."""


@dataclass(frozen=True, slots=True)
class EpisodeResult:
    """One agent run on one task under one arm."""

    task: str
    arm: str
    run: int
    resolved: bool
    """debug-gym's verdict at the end: every collected test passed at the last eval/submit."""
    score: int
    max_score: int
    steps: int
    stop_reason: StopReason
    prompt_tokens: int
    completion_tokens: int
    usage_turns: int
    """Turns whose usage the server reported (token sums cover only these)."""
    policy_edits: int
    directives: int
    fallbacks: int
    leyline_turns: int
    """Turns answered with a ``leyline`` object (a Leyline server)."""
    reused_tokens: int
    prefilled_tokens: int
    rotated_tokens: int
    sessions_dropped: int
    wall_s: float
    error: str | None = None

    @classmethod
    def from_turns(
        cls,
        *,
        task: str,
        arm: str,
        run: int,
        resolved: bool,
        score: int,
        max_score: int,
        stop_reason: StopReason,
        turns: Sequence[TurnRecord],
        wall_s: float,
        error: str | None = None,
    ) -> EpisodeResult:
        usage = [t for t in turns if t.prompt_tokens is not None]
        leyline = [t for t in turns if t.path is not None]
        return cls(
            task=task,
            arm=arm,
            run=run,
            resolved=resolved,
            score=score,
            max_score=max_score,
            steps=len(turns),
            stop_reason=stop_reason,
            prompt_tokens=sum(t.prompt_tokens or 0 for t in usage),
            completion_tokens=sum(t.completion_tokens or 0 for t in usage),
            usage_turns=len(usage),
            policy_edits=sum(t.policy_edits for t in turns),
            directives=sum(t.directives for t in turns),
            fallbacks=sum(t.fallback is not None for t in turns),
            leyline_turns=len(leyline),
            reused_tokens=sum(t.reused_tokens or 0 for t in leyline),
            prefilled_tokens=sum(t.prefilled_tokens or 0 for t in leyline),
            rotated_tokens=sum(t.rotated_tokens or 0 for t in leyline),
            sessions_dropped=sum(t.session_dropped for t in turns),
            wall_s=round(wall_s, 3),
            error=error,
        )

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> EpisodeResult:
        """The inverse of :meth:`to_json` (unknown keys are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})  # type: ignore[arg-type]
