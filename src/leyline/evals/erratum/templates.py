"""Decision prompts whose answer hangs on one field of a record, and the cases drawn from them.

Each template is a few-shot prompt in plain text: a one-line rule, six solved records, then
the query record and the decision label (``Refund:``). SmolLM2-135M cannot apply a written
rule zero-shot (its yes/no margin barely moves with the field, with or without the chat
template); with solved examples its margin moves in the rule's direction, which is what a
decision eval needs. The changed field sits mid-record so that other fields (the
"downstream" tokens where the paper finds the model's notes) follow it.

The decision is read as a constrained choice: ``logit(" yes") - logit(" no")`` at the label.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

Pick = Callable[[random.Random], str]

NAMES = (
    "Alice Moreno", "Tom Becker", "Lena Fox", "Ravi Patel", "Mia Novak", "Omar Haddad",
    "Sara Lind", "Kenji Sato", "Eva Costa", "Noah Brandt", "Ines Duarte", "Paul Weber",
)  # fmt: skip
CITIES = ("Berlin", "Lyon", "Austin", "Osaka", "Porto", "Leeds", "Denver", "Turin")
ITEMS = ("desk lamp", "backpack", "headphones", "kettle", "office chair", "tent", "blender")


def _one_of(options: tuple[str, ...]) -> Pick:
    return lambda rng: rng.choice(options)


def _number(lo: int, hi: int, fmt: str = "{}") -> Pick:
    return lambda rng: fmt.format(rng.randint(lo, hi))


def _money(lo: int, hi: int) -> Pick:
    return lambda rng: f"${rng.randint(lo, hi)}.{rng.randint(0, 99):02d}"


def _date(rng: random.Random) -> str:
    return f"2024-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


@dataclass(frozen=True, slots=True)
class Template:
    """One decision: ``field`` (at record line ``field_index``) decides ``label``.

    ``yes_values`` make the rule answer yes, ``no_values`` no. ``others`` are the record's
    other lines (label, random value), in order; the field is inserted among them.
    """

    name: str
    rule: str
    label: str
    field: str
    field_index: int
    yes_values: tuple[str, ...]
    no_values: tuple[str, ...]
    others: tuple[tuple[str, Pick], ...]

    def record_lines(self, rng: random.Random) -> list[tuple[str, str]]:
        return [(name, pick(rng)) for name, pick in self.others]

    def shots(self) -> str:
        """Six solved records, both answers, every field value used (fixed per template)."""
        rng = random.Random(f"shots:{self.name}")
        values = [*self.yes_values, *self.no_values]
        order = [values[0], values[2], values[1], values[3], values[0], values[2]]
        blocks = []
        for value in order:
            answer = "yes" if value in self.yes_values else "no"
            lines = self.with_field(self.record_lines(rng), value)
            blocks.append(render_lines(lines) + f"{self.label}: {answer}\n\n")
        return "".join(blocks)

    def head(self) -> str:
        return f"{self.rule}\n\n{self.shots()}"

    def with_field(self, lines: list[tuple[str, str]], value: str) -> list[tuple[str, str]]:
        return [*lines[: self.field_index], (self.field, value), *lines[self.field_index :]]

    def answer(self, value: str) -> bool:
        """The rule's answer for ``value`` (what a model that follows the rule says)."""
        return value in self.yes_values


def render_lines(lines: list[tuple[str, str]]) -> str:
    return "".join(f"{name}: {value}\n" for name, value in lines)


TEMPLATES: tuple[Template, ...] = (
    Template(
        name="refund",
        rule="Refund decisions. Rule: lost or damaged orders are refunded; "
        "delivered or shipped orders are not.",
        label="Refund",
        field="Status",
        field_index=2,
        yes_values=("lost", "damaged"),
        no_values=("delivered", "shipped"),
        others=(
            ("Customer", _one_of(NAMES)),
            ("Item", _one_of(ITEMS)),
            ("Amount", _money(9, 400)),
            ("Carrier", _one_of(("UPS", "DHL", "FedEx", "USPS"))),
        ),
    ),
    Template(
        name="access",
        rule="Billing console access. Rule: users with role admin or owner get access; "
        "guest or visitor roles do not.",
        label="Access",
        field="Role",
        field_index=2,
        yes_values=("admin", "owner"),
        no_values=("guest", "visitor"),
        others=(
            ("User", _one_of(NAMES)),
            ("Team", _one_of(("sales", "finance", "support", "research", "legal"))),
            ("Office", _one_of(CITIES)),
            ("Last login", _date),
        ),
    ),
    Template(
        name="shipping",
        rule="Same-day shipping. Rule: ship today if the item is in stock or available; "
        "not if it is out of stock or backordered.",
        label="Ship today",
        field="Stock",
        field_index=2,
        yes_values=("in stock", "available"),
        no_values=("out of stock", "backordered"),
        others=(
            ("Product", _one_of(ITEMS)),
            ("SKU", _number(1000, 9999, "SKU-{}")),
            ("Warehouse", _one_of(CITIES)),
            ("Destination", _one_of(CITIES)),
        ),
    ),
    Template(
        name="approval",
        rule="Loan approvals. Rule: approve when the risk is low or minimal; "
        "reject when the risk is high or severe.",
        label="Approve",
        field="Risk",
        field_index=2,
        yes_values=("low", "minimal"),
        no_values=("high", "severe"),
        others=(
            ("Applicant", _one_of(NAMES)),
            ("Loan", _money(1000, 50000)),
            ("Income", _money(20000, 150000)),
            ("Branch", _one_of(CITIES)),
        ),
    ),
)


@dataclass(frozen=True, slots=True)
class Case:
    """One record whose field changes from ``old`` to ``new`` (one yes value, one no value).

    The prompt is ``before + " " + value + after + question``: the parts are tokenized
    separately so that the field's tokens are known exactly and identical in every arm.
    """

    template: Template
    index: int
    old: str
    new: str
    before: str
    after: str

    @property
    def question(self) -> str:
        return f"{self.template.label}:"


def draw_cases(template: Template, count: int, seed: int) -> list[Case]:
    """``count`` cases; even ones go no -> yes, odd ones yes -> no (balanced directions)."""
    rng = random.Random(f"{seed}:{template.name}")
    cases = []
    for index in range(count):
        lines = template.record_lines(rng)
        yes, no = rng.choice(template.yes_values), rng.choice(template.no_values)
        old, new = (no, yes) if index % 2 == 0 else (yes, no)
        head = render_lines(lines[: template.field_index])
        tail = render_lines(lines[template.field_index :])
        cases.append(Case(template, index, old, new, f"{head}{template.field}:", "\n" + tail))
    return cases
