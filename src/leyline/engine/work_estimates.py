"""How much model time work still needs: the estimates behind the scheduler's ``srpt`` policy.

Shortest remaining processing time first minimises mean response time on one server. A job
is sized in *tokens to run through the model* (:func:`turn_cost`), and tokens become
seconds at rates learned from finished work (:class:`WorkRates`), so no constant here is
tuned to one CPU.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from leyline.core.batch import common_prefix
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode, SelectiveRecompute
from leyline.protocol.resolve import ResolvedCompose

SchedulePolicy = Literal["las", "srpt"]
"""Which ready job the scheduler runs next: least attained service, or shortest remaining
processing time by these estimates (``scheduler``)."""
SCHEDULE_POLICIES: tuple[str, ...] = get_args(SchedulePolicy)

_ALPHA = 0.2
"""Weight of the newest sample in the moving averages."""
_MIN_SIZED_TOKENS = 16
"""Jobs smaller than this teach ``token_s`` nothing (fixed costs dominate them)."""


@dataclass
class WorkRates:
    """Model seconds per job token and per decode step, learned from finished work."""

    token_s: float = 2e-3
    """Model seconds per token of a job (an edit, a prefill): an exponential moving average
    over finished jobs with a size. The default is a prior until the first sized job ends
    (SmolLM2 on two CPU cores: 1-3 ms)."""
    step_s: float = 0.05
    """Seconds per batched decode step, averaged the same way; the default is a prior until
    the first decode step ends."""

    def learn_job(self, tokens: int | None, service_s: float) -> None:
        if tokens is not None and tokens >= _MIN_SIZED_TOKENS and service_s > 0:
            self.token_s += _ALPHA * (service_s / tokens - self.token_s)

    def learn_step(self, seconds: float) -> None:
        if seconds > 0:
            self.step_s += _ALPHA * (seconds - self.step_s)

    def job_left(self, tokens: int | None, service_s: float, chunk_tokens: int) -> float:
        """Seconds a job of ``tokens`` (None: unknown) still needs after ``service_s``. A job
        with no size is taken to be one prefill chunk; once a job has outrun its estimate,
        its attained service is the estimate of what is left (the least-attained-service
        rule: the longer a job has run, the longer it is likely to run still)."""
        expected = (chunk_tokens if tokens is None else tokens) * self.token_s
        left = expected - service_s
        return left if left > 0 else service_s

    def generation_left(self, tokens_left: int) -> float:
        """Seconds of decode steps a generation with ``tokens_left`` still needs."""
        return max(tokens_left, 0) * self.step_s


def turn_cost(
    edited_tokens: Sequence[int],
    edits: Sequence[Edit],
    composes: Sequence[ResolvedCompose],
    prompt: Sequence[int],
) -> int:
    """Tokens a turn's job runs through the model: what its edits compute (a splice's
    replacement, a compose's seam and recomputed share, everything after a FORGET) plus
    the prompt's tokens past what the edited session (``edited_tokens``) already holds. An
    estimate: the prefix cache may serve some of them, and a token late in a long context
    costs more than an early one."""
    seams = {c.index: _compose_tokens(c) for c in composes}
    cost = 0
    forget_from: int | None = None
    for edit in edits:
        if edit.mode is Mode.forget:
            forget_from = edit.start if forget_from is None else min(forget_from, edit.start)
        else:
            cost += seams.get(edit.index, len(edit.replacement))
    if forget_from is not None:
        cost = max(cost, len(edited_tokens) - forget_from)
    if edits and len(edited_tokens) > 0:
        cost += 1  # the last token runs again for the next-token logits
    return cost + len(prompt) - common_prefix(edited_tokens, prompt)


def _compose_tokens(compose: ResolvedCompose) -> int:
    """A compose runs its seam, and with selective recompute that share of the rest (the
    ranking forward of ``attention`` mode, a question's length, is left out)."""
    seam = min(compose.seam_tokens, compose.num_tokens)
    recompute = compose.recompute
    ratio = recompute.ratio if isinstance(recompute, SelectiveRecompute) else 0.0
    return seam + math.ceil(ratio * (compose.num_tokens - seam))
