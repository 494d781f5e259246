"""Token ids of one item: system prompt, old and new profile, trajectory, questions.

The parts are encoded separately and concatenated, so every arm sees the same ids and the
profile block is the same tokens wherever it sits:

* early: ``system + profile + trajectory + question``;
* late: ``system + trajectory + profile + question``;
* none: ``system + trajectory + question``.

A question's candidates are its value and ``choices - 1`` other values of the same field,
each scored by the token it starts with after the question (so the candidates of one
question start with distinct tokens; values whose first token collides are skipped).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from leyline.evals.compose.cases import answer_token

from .profiles import FIELD_BY_KEY, Profile, make_profile, update
from .trajectory import make_trajectory

Encode = Callable[[str], Sequence[int]]

_SYSTEMS = (
    "You are a coding agent working in the user's repository. Run shell commands with the "
    "bash tool, keep answers short, and personalise them with what you know about the user.",
    "You are a helpful assistant with tools. Use the user memory below when the user asks "
    "about themselves; answer in a few words.",
    "You are an engineering copilot. Be exact, and remember the facts the user shared with you.",
)


@dataclass(frozen=True, slots=True)
class Question:
    key: str
    """The profile field asked about."""
    changed: bool
    """Whether the update changed this fact."""
    tokens: tuple[int, ...]
    """The user turn and the assistant's reply opened up to the value."""
    candidates: tuple[str, ...]
    """The right value first, then the distractors."""
    candidate_tokens: tuple[int, ...]
    """First token of each candidate after the question (distinct)."""


@dataclass(frozen=True, slots=True)
class Item:
    index: int
    budget: int
    """Requested trajectory tokens."""
    old: Profile
    new: Profile
    changed: tuple[str, ...]
    system: tuple[int, ...]
    old_profile: tuple[int, ...]
    profile: tuple[int, ...]
    """The new profile's block: what every profile arm answers from."""
    trajectory: tuple[int, ...]
    questions: tuple[Question, ...]

    @property
    def early(self) -> tuple[int, ...]:
        """The context before a question with the profile early."""
        return self.system + self.profile + self.trajectory

    @property
    def early_old(self) -> tuple[int, ...]:
        """What the early session held before the update."""
        return self.system + self.old_profile + self.trajectory

    @property
    def base(self) -> tuple[int, ...]:
        """The late arms' cached context: system prompt and trajectory."""
        return self.system + self.trajectory


def _ids(encode: Encode, text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in encode(text))


def question_text(key: str) -> str:
    field = FIELD_BY_KEY[key]
    return f"<|im_start|>user\n{field.question}<|im_end|>\n<|im_start|>assistant\n{field.stub}"


def make_question(
    key: str, value: str, changed: bool, choices: int, encode: Encode, rng: random.Random
) -> Question | None:
    """The question about ``key`` with ``choices`` candidates (None when the right value's
    first token cannot be told from the question's)."""
    text = question_text(key)
    first = answer_token(encode, text, " " + value)
    if first is None:
        return None
    values, tokens = [value], [first]
    others = [v for v in FIELD_BY_KEY[key].pool if v != value]
    rng.shuffle(others)
    for other in others:
        token = answer_token(encode, text, " " + other)
        if len(values) < choices and token is not None and token not in tokens:
            values.append(other)
            tokens.append(token)
    return Question(key, changed, _ids(encode, text), tuple(values), tuple(tokens))


def make_item(
    index: int,
    *,
    facts: int,
    changes: int,
    budget: int,
    questions: int,
    choices: int,
    encode: Encode,
    seed: int,
) -> Item:
    """Item ``index``: user ``index``'s profile before and after an update, a trajectory of
    about ``budget`` tokens and ``questions`` questions about the updated profile (up to
    half of them about facts the update changed), in a seeded order."""
    old = make_profile(facts, seed, index)
    new, changed = update(old, changes, seed)
    rng = random.Random(f"memory:{seed}:questions:{index}")
    # Up to half the questions about facts the update changed, the rest about kept ones.
    fresh = [k for k, _ in new.facts if k in changed]
    kept = [k for k, _ in new.facts if k not in changed]
    rng.shuffle(fresh)
    rng.shuffle(kept)
    asked: list[Question] = []
    for keys, want in ((fresh, min(len(fresh), questions // 2)), (kept, questions)):
        for key in keys:
            if len(asked) == want:
                break
            q = make_question(key, new.value(key), key in changed, choices, encode, rng)
            if q is not None and len(q.candidates) == choices:
                asked.append(q)
    rng.shuffle(asked)
    if not asked:
        raise ValueError(f"item {index}: no question has {choices} distinct candidates")
    system = f"<|im_start|>system\n{rng.choice(_SYSTEMS)}<|im_end|>\n"
    return Item(
        index=index,
        budget=budget,
        old=old,
        new=new,
        changed=changed,
        system=_ids(encode, system),
        old_profile=_ids(encode, old.render()),
        profile=_ids(encode, new.render()),
        trajectory=_ids(encode, make_trajectory(budget, seed, index, encode)),
        questions=tuple(asked),
    )
