"""One decision item through every arm, timed, on the reference engine.

Every arm reads the next-token logits after the same question tokens:

* ``full``: the prefix prefilled, then skill + question on its KV (the reference);
* ``compose_k{K}``: ``SessionCache.compose(skill, len(prefix), seam_tokens=K)``, then the
  question prefilled fresh (the server's path);
* ``compose_k{K}_dev{P}`` / ``compose_k{K}_ask{P}``: the same with selective recompute of
  ``P``% of the block, chosen by KV deviation or by the question's attention (the server's
  ``deviation`` and ``attention`` modes);
* ``anchored_k{K}`` (``_ask{P}``): the skill compiled after an anchor whose KV is dropped;
* ``norot_k{K}``: the control, keys left where they were computed (:func:`unrotated`);
* ``no_skill``: the skill left out.

See docs/reports/eval-compose.md.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from leyline.engine.edits.skills import Skill, rotate_keys
from leyline.engine.engine import Engine
from leyline.engine.session import SessionCache
from leyline.protocol.directives import Recompute, RecomputeAttention, RecomputeDeviation

from .cases import Item
from .measures import Agreement, compare

FULL, NO_SKILL = "full", "no_skill"


def compose_arm(seam: int) -> str:
    return f"compose_k{seam}"


def control_arm(seam: int) -> str:
    return f"norot_k{seam}"


def deviation_arm(seam: int, ratio: float) -> str:
    """``compose_k16_dev15`` for K = 16, ratio 0.15."""
    return f"compose_k{seam}_dev{round(ratio * 100, 1):g}"


def ask_arm(seam: int, ratio: float) -> str:
    """``compose_k16_ask15`` for K = 16, ratio 0.15."""
    return f"compose_k{seam}_ask{round(ratio * 100, 1):g}"


def anchored_arm(seam: int, ask_ratio: float | None = None) -> str:
    """``anchored_k16``; with a question-aware ratio, ``anchored_k16_ask15``."""
    head = f"anchored_k{seam}"
    return head if ask_ratio is None else f"{head}_ask{round(ask_ratio * 100, 1):g}"


def plain_compose_seam(arm: str) -> int | None:
    """K of a ``compose_k{K}`` arm (no recompute), else None."""
    rest = arm.removeprefix("compose_k")
    return int(rest) if rest != arm and rest.isdigit() else None


@dataclass(frozen=True, slots=True)
class ArmSet:
    """The compose arms of a run besides ``full`` and ``no_skill``."""

    seams: tuple[int, ...]
    control_seam: int
    recompute_seam: int = 16
    ratios: tuple[float, ...] = ()
    """Deviation ratios, each one ``compose_k{recompute_seam}_dev{P}`` arm."""
    ask_ratios: tuple[float, ...] = ()
    """Question-aware ratios, each one ``compose_k{recompute_seam}_ask{P}`` arm."""
    anchored: bool = False
    """One ``anchored_k{recompute_seam}`` arm (the run compiles the anchored skill)."""

    def deviation_arms(self) -> list[tuple[str, float]]:
        return [(deviation_arm(self.recompute_seam, r), r) for r in self.ratios]

    def ask_arms(self) -> list[tuple[str, float]]:
        return [(ask_arm(self.recompute_seam, r), r) for r in self.ask_ratios]

    def anchored_ask_arms(self) -> list[tuple[str, float]]:
        """Question-aware recompute on the anchored skill, per ask ratio (when anchored)."""
        if not self.anchored:
            return []
        return [(anchored_arm(self.recompute_seam, r), r) for r in self.ask_ratios]

    def recompute_arms(self) -> list[str]:
        """The arms that go past the plain compose at ``recompute_seam``: selective
        recompute (deviation, question-aware), the anchored compile, and the anchored
        compile with question-aware recompute."""
        names = [name for name, _ in self.deviation_arms() + self.ask_arms()]
        anchored = [anchored_arm(self.recompute_seam)] if self.anchored else []
        return names + anchored + [name for name, _ in self.anchored_ask_arms()]


def unrotated(engine: Engine, skill: Skill, at: int) -> Skill:
    """``skill`` with its keys' rope band pre-rotated by ``-at``.

    COMPOSE rotates the copied keys by ``at``; rotations compose exactly (up to fp32
    rounding), so this skill lands with its keys as compiled, at positions ``0..L-1``,
    while it sits at ``at..at+L-1``: the skill's KV copied without rotation. Values (and
    everything outside the band) are untouched, and the seam is prefilled as in any
    compose, so the only difference from ``compose_k{K}`` is the missing rotation.
    """
    return dataclasses.replace(skill, kv=rotate_keys(engine, skill.kv, -at))


@dataclass(frozen=True, slots=True)
class ItemResult:
    item: Item
    skill_length: int
    prefix_seconds: float
    """Prefill of the prefix alone (what "cold" timings add)."""
    seconds: dict[str, float]
    """Per arm (``full`` and composes): prefix cached -> next-token logits after the question."""
    agreement: dict[str, Agreement]
    """Per arm, vs ``full`` (``full`` itself included: its answer probability)."""
    paths: dict[str, str]
    """What the engine ran for each compose: ``splice`` (anything else is a fallback)."""


def timed_compose(
    prefix: SessionCache,
    skill: Skill,
    seam: int,
    question: Sequence[int],
    recompute: Recompute | None = None,
) -> tuple[torch.Tensor, float, str]:
    """A chat turn's path: the compose (its recompute ranked, in ``attention`` mode, by the
    question that follows it), then the question prefilled."""
    session = prefix.fork()  # shares the prefix's tensors, never writes them
    t0 = time.perf_counter()
    final = (*prefix.tokens, *skill.tokens, *question)
    at = len(prefix.tokens)
    report = session.compose(skill, at, seam_tokens=seam, recompute=recompute, final_tokens=final)
    session.extend(question)
    logits = session.next_token_logits()
    return logits, time.perf_counter() - t0, report.path.value


def deviation_mode(ratio: float) -> RecomputeDeviation:
    return RecomputeDeviation(mode="deviation", ratio=ratio)


def attention_mode(ratio: float) -> RecomputeAttention:
    return RecomputeAttention(mode="attention", ratio=ratio)


@torch.inference_mode()
def run_item(
    engine: Engine, skill: Skill, item: Item, arms: ArmSet, anchored: Skill | None = None
) -> ItemResult:
    """Every arm on ``item``; even items time the full prefill first, odd ones last, so
    neither arm always runs on a warmer machine. ``anchored``: the skill compiled after the
    anchor, for ``arms.anchored``."""
    assert (anchored is not None) == arms.anchored, "the anchored arm needs its skill"
    prefix = SessionCache(engine)
    t0 = time.perf_counter()
    prefix.prefill(item.prefix)
    prefix_seconds = time.perf_counter() - t0
    at = len(item.prefix)

    logits: dict[str, torch.Tensor] = {}
    seconds: dict[str, float] = {}
    paths: dict[str, str] = {}

    def full() -> None:
        t0 = time.perf_counter()
        _, logits[FULL] = engine.forward(prefix.kv, skill.tokens + item.question)
        seconds[FULL] = time.perf_counter() - t0

    def composes() -> None:
        for seam in arms.seams:
            name = compose_arm(seam)
            logits[name], seconds[name], paths[name] = timed_compose(
                prefix, skill, seam, item.question
            )
        for name, ratio in arms.deviation_arms():
            logits[name], seconds[name], paths[name] = timed_compose(
                prefix, skill, arms.recompute_seam, item.question, deviation_mode(ratio)
            )
        for name, ratio in arms.ask_arms():
            logits[name], seconds[name], paths[name] = timed_compose(
                prefix, skill, arms.recompute_seam, item.question, attention_mode(ratio)
            )
        if anchored is not None:
            name = anchored_arm(arms.recompute_seam)
            logits[name], seconds[name], paths[name] = timed_compose(
                prefix, anchored, arms.recompute_seam, item.question
            )
            for name, ratio in arms.anchored_ask_arms():
                logits[name], seconds[name], paths[name] = timed_compose(
                    prefix, anchored, arms.recompute_seam, item.question, attention_mode(ratio)
                )
        name = control_arm(arms.control_seam)
        control = unrotated(engine, skill, at)
        logits[name], seconds[name], paths[name] = timed_compose(
            prefix, control, arms.control_seam, item.question
        )

    for step in (full, composes) if item.index % 2 == 0 else (composes, full):
        step()
    alone = prefix.fork()
    alone.extend(item.question)
    logits[NO_SKILL] = alone.next_token_logits()

    reference = logits[FULL]
    agreement = {name: compare(reference, lg, item.answer_token) for name, lg in logits.items()}
    return ItemResult(item, len(skill), prefix_seconds, seconds, agreement, paths)
