"""Constrained choice: which candidate the model's first answer token picks.

A 135M model's free answers are too noisy to grade, so each task is scored as a choice
among its candidates (the distractors and the answer) from the first generated token's
top-k logprobs, which every OpenAI-compatible server can return (``top_logprobs`` <= 20).

A candidate's score is the probability mass of the top-k tokens that name it: the token's
text (spaces stripped, case ignored) equals the candidate, or is a prefix of it and of no
other candidate (for tokenizers that split the word). The choice is the best-scored candidate. With
single-token candidates (SmolLM2, see ``tasks``) this is the argmax over all candidates:
one missing from the top-k has less probability than every token in it. When no candidate
is in the top-k, the task is ``unscored`` and counts as wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from leyline.evals.common.report import json_fields

TopLogprobs = Sequence[tuple[str, float]]
"""(token text, logprob) of the first generated token's top candidates."""


@dataclass(frozen=True, slots=True)
class Choice:
    """The choice one arm made on one task."""

    scores: dict[str, float]
    """Logprob per candidate found in the top-k (missing: not in the top-k)."""
    choice: str | None
    """The best-scored candidate; None when none was in the top-k."""
    correct: bool
    margin: float | None
    """Answer's logprob minus the best distractor's (None unless both are in the top-k)."""
    top1: str | None
    """The most likely first token (text), whatever it is."""

    def to_json(self) -> dict[str, object]:
        return json_fields(self, "choice", "correct", "margin", "top1", "scores")


def choose(top: TopLogprobs, candidates: Sequence[str], answer: str) -> Choice:
    """Score ``candidates`` from ``top``; ``answer`` is the right one."""
    if answer not in candidates:
        raise ValueError(f"the answer {answer!r} is not among the candidates {candidates}")
    scores: dict[str, float] = {}
    for token, logprob in top:
        name = _candidate_of(token.strip(), candidates)
        if name is not None:
            old = scores.get(name)
            scores[name] = logprob if old is None else _logaddexp(old, logprob)
    choice = max(scores, key=lambda c: scores[c]) if scores else None
    distractors = [scores[c] for c in candidates if c != answer and c in scores]
    margin = None
    if answer in scores and distractors:
        margin = scores[answer] - max(distractors)
    return Choice(
        scores=scores,
        choice=choice,
        correct=choice == answer,
        margin=margin,
        top1=top[0][0] if top else None,
    )


def _candidate_of(text: str, candidates: Sequence[str]) -> str | None:
    # Case-insensitive: a model answers " gold" as readily as " Gold".
    key = text.casefold()
    if not key:
        return None
    named = [c for c in candidates if c.casefold() == key]
    if not named:
        named = [c for c in candidates if c.casefold().startswith(key)]
    return named[0] if len(named) == 1 else None


def _logaddexp(a: float, b: float) -> float:
    high, low = max(a, b), min(a, b)
    return high + math.log1p(math.exp(low - high))
