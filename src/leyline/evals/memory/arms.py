"""One item through every arm, on the reference engine: the profile update timed, then
every question scored.

The user's profile changes while an agent trajectory is cached; each arm brings its cache up
to date and answers the first question, which is its cost (tokens prefilled, time to the
first next-token logits):

* ``early_full``: profile after the system prompt; everything from its changed line on is
  prefilled again (what a prefix cache allows);
* ``late_full``: profile after the trajectory, before the question; new profile and question
  prefilled on ``system + trajectory`` (the reference);
* ``late_compose_k{K}``: the same placement, the profile compiled once as a skill and
  composed (keys rotated, K seam tokens recomputed); compiling is counted apart;
* ``none``: no profile (the chance baseline).

Even items run ``early_full`` first, odd ones last. See docs/reports/eval-memory.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from leyline.core.batch import common_prefix
from leyline.engine.edits.skills import compile_skill
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache
from leyline.evals.compose.measures import Agreement, compare

from .cases import Item, Question

EARLY, LATE, NONE = "early_full", "late_full", "none"
TOP = 20
"""The top tokens of ``late_full`` over which ``max_dlogp`` is taken."""


def compose_arm(seam: int) -> str:
    return f"late_compose_k{seam}"


def compose_seam(arm: str) -> int | None:
    """K of a ``late_compose_k{K}`` arm, else None."""
    rest = arm.removeprefix("late_compose_k")
    return int(rest) if rest != arm and rest.isdigit() else None


def arm_names(seams: Sequence[int]) -> list[str]:
    return [EARLY, LATE, *(compose_arm(k) for k in seams), NONE]


@dataclass(frozen=True, slots=True)
class Cost:
    """Bringing the context up to date after the update and answering the first question."""

    seconds: float
    prefilled: int
    reused: int
    path: str
    """The engine's path for the update step (``splice`` for a compose)."""


@dataclass(frozen=True, slots=True)
class Score:
    """One arm's answer to one question, from the next-token logits after it."""

    logps: tuple[float, ...]
    """Log-probability (full vocabulary) of each candidate's first token, right one first."""
    correct: bool
    """The right candidate has the highest log-probability of the candidates."""
    greedy: bool
    """The right candidate's first token is the argmax over the whole vocabulary."""
    p_right: float
    """The right candidate's probability renormalised over the candidates."""


@dataclass(frozen=True, slots=True)
class Versus:
    """One arm's next-token logits against ``late_full``'s, one question."""

    agreement: Agreement
    max_dlogp: float
    """max |log p_arm - log p_late_full| over late_full's top ``TOP`` tokens."""


@dataclass(frozen=True, slots=True)
class ItemResult:
    item: Item
    costs: dict[str, Cost]
    compile_seconds: float
    """Registering the new profile as a skill (its prefill alone from position 0)."""
    base_seconds: float
    """Prefill of system + trajectory (the late arms' cached state; not in any cost)."""
    profile_nbytes: int
    """KV bytes of the registered profile."""
    scores: dict[str, list[Score]]
    """Per arm, one per question."""
    versus: dict[str, list[Versus]]
    """Per arm, one per question, against ``late_full``."""


def score(logits: torch.Tensor, question: Question) -> Score:
    logp = torch.log_softmax(logits.double().flatten(), -1)
    cand = logp[list(question.candidate_tokens)]
    return Score(
        logps=tuple(float(v) for v in cand),
        correct=int(cand.argmax()) == 0,
        greedy=int(logp.argmax()) == question.candidate_tokens[0],
        p_right=float(torch.softmax(cand, -1)[0]),
    )


def versus(reference: torch.Tensor, logits: torch.Tensor, question: Question) -> Versus:
    ref = torch.log_softmax(reference.double().flatten(), -1)
    arm = torch.log_softmax(logits.double().flatten(), -1)
    top = ref.topk(TOP).indices
    return Versus(
        compare(reference, logits, question.candidate_tokens[0]),
        float((ref[top] - arm[top]).abs().max()),
    )


Update = Callable[[SessionCache], tuple[int, int, str]]
"""Brings a fork of an arm's starting state up to date in place; returns the tokens it
prefilled and reused and the engine's path."""


def _timed(
    start: SessionCache, update: Update, q: Question
) -> tuple[SessionCache, torch.Tensor, Cost]:
    """Fork ``start``, update it (timed, with the first question and its logits); returns
    the updated context (before the question), the question's logits and the cost."""
    context = start.fork()
    t0 = time.perf_counter()
    prefilled, reused, path = update(context)
    asked = context.fork()
    report = asked.extend(q.tokens)
    logits = asked.next_token_logits()
    seconds = time.perf_counter() - t0
    cost = Cost(seconds, prefilled + report.prefilled_tokens, reused, path)
    return context, logits, cost


@torch.inference_mode()
def run_item(engine: Engine, item: Item, seams: Sequence[int]) -> ItemResult:
    """Every arm on ``item``."""
    first, rest = item.questions[0], item.questions[1:]
    base = SessionCache(engine)
    t0 = time.perf_counter()
    base.prefill(item.base)
    base_seconds = time.perf_counter() - t0
    early = SessionCache(engine)
    early.prefill(item.early_old[: common_prefix(item.early_old, item.early + first.tokens)])
    t0 = time.perf_counter()
    skill = compile_skill(engine, item.profile, skill_id=f"profile-{item.index}", tenant="eval")
    compile_seconds = time.perf_counter() - t0
    at = len(item.base)

    def prefill_early(s: SessionCache) -> tuple[int, int, str]:
        r = s.prefill(item.early)
        return r.prefilled_tokens, r.reused_tokens, r.path.value

    def extend_late(s: SessionCache) -> tuple[int, int, str]:
        r = s.extend(item.profile)
        return r.prefilled_tokens, r.reused_tokens, r.path.value

    def composer(seam: int) -> Update:
        def run(s: SessionCache) -> tuple[int, int, str]:
            r = s.compose(skill, at, seam_tokens=seam)
            return r.prefilled_tokens, r.reused_tokens, r.path.value

        return run

    def nothing(s: SessionCache) -> tuple[int, int, str]:
        return 0, len(s.tokens), "none"

    late_arms: list[tuple[str, SessionCache, Update]]
    late_arms = [(LATE, base, extend_late)]
    late_arms += [(compose_arm(k), base, composer(k)) for k in seams]
    late_arms += [(NONE, base, nothing)]
    order = [(EARLY, early, prefill_early), *late_arms]
    if item.index % 2:
        order = [*late_arms, order[0]]

    contexts: dict[str, SessionCache] = {}
    logits: dict[str, list[torch.Tensor]] = {}
    costs: dict[str, Cost] = {}
    for name, start, update in order:
        contexts[name], lg, costs[name] = _timed(start, update, first)
        logits[name] = [lg]
    for name, context in contexts.items():
        for q in rest:
            asked = context.fork()
            asked.extend(q.tokens)
            logits[name].append(asked.next_token_logits())

    names = arm_names(seams)
    scores = {n: [score(lg, q) for lg, q in zip(logits[n], item.questions, strict=True)]
              for n in names}  # fmt: skip
    versus_late = {
        n: [
            versus(ref, lg, q)
            for ref, lg, q in zip(logits[LATE], logits[n], item.questions, strict=True)
        ]
        for n in names
    }
    return ItemResult(item, costs, compile_seconds, base_seconds, skill.nbytes, scores, versus_late)
