"""Tasks with stale tool outputs: an agent polls one tool; only the latest poll is current.

Each task is generated from ``(seed, index, stale)`` alone (no downloads, no model). The
agent watches one thing (a shipment, a job, ...): it polls a tool, waits, polls again,
``stale + 1`` polls in all. The first ``stale`` polls show now-stale values of one field
(the distractors); the last shows the current value (the answer). The final user question
asks for the current value; scoring is a choice among the candidates (the distinct values
shown), so chance is ``1 / len(candidates)``.

Why the ``wait`` turns: a monitoring agent waits between polls, and with them the paper's
``TruncateOldToolOutputs(keep_last=2)`` keeps only the last wait and the last poll, so it
removes every distractor, and each stub has a cached turn after it that a splice keeps
(with ``keep_last=1`` and polls alone, a stale output is stubbed only when nothing but the
unsent reply follows it, and a splice would save nothing).

Values are words that SmolLM2's tokenizer keeps as one token with and without a leading
space, so the first answer token names the candidate (see ``scoring``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal

from leyline.evals.common.messages import ToolTurn
from leyline.evals.common.report import json_fields

DistractorMode = Literal["repeat", "mixed"]
"""``repeat``: every stale poll shows the same distractor (frequency pulls the wrong way);
``mixed``: the stale polls show two or three distractors."""


@dataclass(frozen=True, slots=True)
class Family:
    """One kind of polled state: a tool, the field that changes, the words it takes."""

    name: str
    tool: str
    argument: str
    """The tool's one argument (the key: shipment id, job id, ...)."""
    key_format: str
    """``str.format`` template of a key, given ``n`` (a number)."""
    field: str
    values: tuple[str, ...]
    noise: tuple[tuple[str, tuple[str, ...]], ...]
    """Fields that stay the same across a task's polls (one choice each per task)."""


FAMILIES: tuple[Family, ...] = (
    Family(
        name="shipment",
        tool="track_shipment",
        argument="shipment_id",
        key_format="SH-{n}",
        field="location",
        values=("Paris", "Rome", "Boston", "London", "Chicago", "Florida", "Texas", "Virginia"),
        noise=(("carrier", ("DHL", "UPS", "FedEx")), ("parcels", ("1", "2", "3", "4"))),
    ),
    Family(
        name="job",
        tool="get_job_status",
        argument="job_id",
        key_format="job-{n}",
        field="state",
        values=("Running", "Ready", "Active", "Done", "Starting", "Online", "Unknown", "Complete"),
        noise=(("queue", ("batch", "nightly", "etl")), ("owner", ("mira", "tomas", "ines"))),
    ),
    Family(
        name="region",
        tool="get_alert_level",
        argument="region",
        key_format="R-{n}",
        field="alert level",
        values=("Green", "Yellow", "Red", "Black", "White", "Blue", "Gold", "Silver"),
        noise=(("source", ("sensor grid", "field report")), ("sites", ("12", "31", "47"))),
    ),
    Family(
        name="courier",
        tool="get_courier_zone",
        argument="courier_id",
        key_format="C-{n}",
        field="zone",
        values=("North", "South", "East", "West", "Central"),
        noise=(("vehicle", ("bike", "van", "scooter")), ("shift", ("early", "late"))),
    ),
)

SYSTEM = (
    "You are an operations agent. You call tools to check on things for the user, then "
    "answer the user's question in one word."
)
WAIT_TOOL = "wait"


@dataclass(frozen=True, slots=True)
class Task:
    """One task: the tool turns in order (polls and waits) and the question."""

    index: int
    family: str
    key: str
    field: str
    mode: DistractorMode
    values: tuple[str, ...]
    """The field's value in each poll, oldest first; ``values[-1]`` is the answer."""
    turns: tuple[ToolTurn, ...]
    """Poll, wait, poll, ..., poll: ``2 * stale + 1`` tool turns; the last is the answer's."""
    request: str
    """The user's opening request."""
    question: str
    """The final user question."""

    @property
    def stale(self) -> int:
        return len(self.values) - 1

    @property
    def polls(self) -> tuple[ToolTurn, ...]:
        return self.turns[::2]

    @property
    def answer(self) -> str:
        return self.values[-1]

    @property
    def distractors(self) -> tuple[str, ...]:
        """The stale values, distinct, in order of first appearance."""
        return tuple(dict.fromkeys(self.values[:-1]))

    @property
    def candidates(self) -> tuple[str, ...]:
        """What the model chooses among: the distractors and the answer, sorted."""
        return tuple(sorted({*self.values}))

    @property
    def subject(self) -> str:
        """How the question names the polled thing (``shipment SH-1234``)."""
        return f"{self.family} {self.key}"

    @property
    def answer_prefix(self) -> str:
        """How the assistant's answer starts; the next token names the value."""
        return f"The {self.field} of {self.subject} is"

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": self.request}]

    def tool_turn(self, turn: int) -> list[dict[str, Any]]:
        """Tool turn ``turn`` (1-based): the assistant's call and the tool's output."""
        return self.turns[turn - 1].messages(turn)

    def question_message(self) -> dict[str, Any]:
        return {"role": "user", "content": self.question}

    def to_json(self) -> dict[str, Any]:
        return json_fields(
            self, "index", "family", "key", "stale", "mode", "values", "answer", "candidates"
        )


def make_task(seed: int, index: int, stale: int) -> Task:
    """Task ``index`` of the set drawn with ``seed``, with ``stale`` stale polls (>= 1)."""
    if stale < 1:
        raise ValueError(f"a task needs at least one stale poll, got stale={stale}")
    # A string seed: random.Random hashes it with SHA-512, stable across runs and platforms.
    rng = random.Random(f"leyline-proxy:{seed}:{index}:{stale}")
    family = FAMILIES[index % len(FAMILIES)]
    key = family.key_format.format(n=rng.randrange(1000, 10000))
    answer, *pool = rng.sample(family.values, len(family.values))
    mode: DistractorMode = "repeat" if stale == 1 or rng.random() < 0.5 else "mixed"
    if mode == "repeat":
        stale_values = [pool[0]] * stale
    else:
        used = pool[: min(stale, rng.choice((2, 3)))]
        # Every distractor shows at least once; the rest at random, shuffled.
        stale_values = used + [rng.choice(used) for _ in range(stale - len(used))]
        rng.shuffle(stale_values)
    values = (*stale_values, answer)
    noise = [(name, rng.choice(choices)) for name, choices in family.noise]
    minute = rng.randrange(7 * 60, 10 * 60)  # the clock, in minutes after midnight
    subject = f"{family.name} {key}"
    turns: list[ToolTurn] = []
    for i, value in enumerate(values):
        if i:
            wait = rng.choice((10, 15, 20, 30))
            output = (
                f"Waited {wait} minutes ({_clock(minute)} to {_clock(minute + wait)}). "
                "Nothing else needs attention."
            )
            turns.append(ToolTurn(WAIT_TOOL, {"minutes": wait}, output))
            minute += wait
        lines = [
            f"{subject}, checked at {_clock(minute)}",
            f"{family.field}: {value}",
            *(f"{name}: {choice}" for name, choice in noise),
        ]
        turns.append(ToolTurn(family.tool, {family.argument: key}, "\n".join(lines)))
    return Task(
        index=index,
        family=family.name,
        key=key,
        field=family.field,
        mode=mode,
        values=values,
        turns=tuple(turns),
        request=f"Keep an eye on {subject} with {family.tool}; I will ask you about it.",
        question=f"What is the {family.field} of {subject} now? Answer with one word.",
    )


def make_tasks(seed: int, count: int, stale_levels: tuple[int, ...]) -> list[Task]:
    """``count`` tasks, the stale levels taken in turn (task i has ``stale_levels[i % n]``)."""
    if not stale_levels:
        raise ValueError("give at least one stale level")
    return [make_task(seed, i, stale_levels[i % len(stale_levels)]) for i in range(count)]


def _clock(minute: int) -> str:
    return f"{minute // 60 % 24:02d}:{minute % 60:02d}"
