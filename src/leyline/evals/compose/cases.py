"""Token ids of the skills and the decision items (prefix, question, answer token).

The three parts are encoded separately and concatenated, so every arm sees the same ids and
the insertion point is exact: full context = prefix + skill + question, compose inserts the
skill at ``len(prefix)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .contexts import Context, make_context
from .texts import Kind, SkillText, skill_text

Encode = Callable[[str], Sequence[int]]
CONTEXT_RESERVE = 256
"""Positions first set aside for the prefix and the question when a skill length is capped
by the model's context (``--full``'s 8k on SmolLM2's 8,192 positions); :func:`fit_case`
then shortens the skill until every item fits."""


@dataclass(frozen=True, slots=True)
class SkillCase:
    kind: Kind
    requested: int
    """The length asked for; ``len(tokens)`` is at most this (whole units only)."""
    tokens: tuple[int, ...]
    units: int


@dataclass(frozen=True, slots=True)
class Item:
    """One decision: a context around the skill and the token the answer starts with."""

    kind: Kind
    requested: int
    index: int
    unit: int
    """Which unit of the skill the question is about."""
    depth: float
    """``unit / units``: how deep in the skill the answer sits."""
    prefix: tuple[int, ...]
    question: tuple[int, ...]
    answer: str
    answer_token: int | None
    """First token of ``answer`` after the question (None if the tokenizer merges it with
    the question's last token: then no answer probability is reported)."""


def _ids(encode: Encode, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in encode(text))


def fit_units(text: SkillText, budget: int, encode: Encode) -> int:
    """The most units whose rendered skill is at most ``budget`` tokens (at least one)."""
    size = len(_ids(encode, text.header + text.footer))
    count = 0
    for unit in text.units:  # units encoded alone: an estimate, corrected below
        size += len(_ids(encode, unit.text + text.separator))
        if size > budget:
            break
        count += 1
    while count > 1 and len(_ids(encode, text.render(count))) > budget:
        count -= 1
    return max(count, 1)


def make_skill(kind: Kind, requested: int, budget: int, encode: Encode, seed: int) -> SkillCase:
    text = skill_text(kind, seed)
    count = fit_units(text, min(requested, budget), encode)
    return SkillCase(kind, requested, _ids(encode, text.render(count)), count)


def _context(text: SkillText, unit: int, seed: str, earlier_turns: int) -> Context:
    return make_context(text, text.units[unit], random.Random(seed), earlier_turns)


def answer_token(encode: Encode, question: str, answer: str) -> int | None:
    head, whole = _ids(encode, question), _ids(encode, question + answer)
    if len(whole) <= len(head) or whole[: len(head)] != head:
        return None
    return whole[len(head)]


def make_items(
    skill: SkillCase, count: int, encode: Encode, seed: int, prefix_tokens: int = 0
) -> list[Item]:
    """``count`` items asking about units spread evenly through the skill; item ``i`` has
    the same prefix at every skill length. ``prefix_tokens``: each prefix grown by earlier
    conversation to at least that many tokens, so the skill lands that deep."""
    text = skill_text(skill.kind, seed)
    eligible = [i for i in range(skill.units) if text.units[i].question]
    items = []
    for index in range(count):
        unit = eligible[min(int((index + 0.5) / count * len(eligible)), len(eligible) - 1)]
        draw = f"compose:{seed}:{skill.kind}:context:{index}"
        ctx, earlier = _context(text, unit, draw, 0), 0
        while len(_ids(encode, ctx.prefix)) < prefix_tokens:
            earlier += 1
            ctx = _context(text, unit, draw, earlier)
        items.append(
            Item(
                kind=skill.kind,
                requested=skill.requested,
                index=index,
                unit=unit,
                depth=unit / skill.units,
                prefix=_ids(encode, ctx.prefix),
                question=_ids(encode, ctx.question),
                answer=ctx.answer,
                answer_token=answer_token(encode, ctx.question, ctx.answer),
            )
        )
    return items


def context_positions(max_session_tokens: int | None) -> int:
    """The positions a model's context holds (``max_session_tokens``; None: no limit)."""
    return max_session_tokens or 1 << 30


def fit_case(
    kind: Kind, requested: int, encode: Encode, seed: int, count: int, *,
    max_session_tokens: int | None, prefix_tokens: int = 0,
) -> tuple[SkillCase, list[Item]]:  # fmt: skip
    """The skill (at most ``requested`` tokens, first capped at the context less
    ``CONTEXT_RESERVE`` and ``prefix_tokens``) and its ``count`` items, shortened by whole
    units until every item's prefix + skill + question fits in the context.

    Raises:
        ValueError: when even a one-unit skill leaves an item past the context.
    """
    limit = context_positions(max_session_tokens)
    budget = limit - CONTEXT_RESERVE - prefix_tokens
    while True:
        case = make_skill(kind, requested, budget, encode, seed)
        items = make_items(case, count, encode, seed, prefix_tokens)
        need = len(case.tokens) + max(len(i.prefix) + len(i.question) for i in items)
        if need <= limit:
            return case, items
        if case.units == 1:
            raise ValueError(
                f"a one-unit {kind} skill with its contexts takes {need} positions; "
                f"the model has {limit}"
            )
        budget = len(case.tokens) - (need - limit)
