"""Seeded skill texts of three kinds, each a list of units that one question can be about.

* ``policy``: numbered support rules; most route a topic to a team ("Tickets about late
  invoices go to the Falcon team."); the question asks which team handles a topic.
* ``passage``: gazetteer paragraphs, one town each; the question asks what a town's economy
  rests on (retrieval of one fact among many alike).
* ``tools``: a JSON list of function schemas, one distinct verb per tool; the question asks
  for a task that one tool does and the assistant opens a tool call.

A skill of ``n`` tokens is the header and the first units that fit (``cases.py``), so a
shorter skill is a prefix of a longer one of the same seed. The answer of every question
is a word the unit states; its first token is the designated answer token.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Kind = Literal["policy", "passage", "tools"]
KINDS: tuple[Kind, ...] = ("policy", "passage", "tools")
MAX_UNITS = 400  # more than 8k tokens of every kind


@dataclass(frozen=True, slots=True)
class Unit:
    """One rule / paragraph / tool, and the question it answers."""

    text: str
    question: str
    """The user's question (it goes after the skill)."""
    stub: str
    """The assistant's reply up to the answer."""
    answer: str
    """What follows ``stub`` (its first token is the designated answer token)."""


@dataclass(frozen=True, slots=True)
class SkillText:
    kind: Kind
    header: str
    units: tuple[Unit, ...]
    separator: str
    footer: str
    intro: str
    """How the user turn before the skill announces it."""

    def render(self, count: int) -> str:
        body = self.separator.join(u.text for u in self.units[:count])
        return self.header + body + self.footer


# -- policy ----------------------------------------------------------------------------

_ADJ = (
    "late", "damaged", "missing", "duplicate", "refunded", "disputed", "expired", "locked",
    "delayed", "foreign", "bulk", "priority", "recurring", "partial", "cancelled", "unpaid",
    "flagged", "archived", "corporate", "student",
)  # fmt: skip
_NOUN = (
    "deliveries", "invoices", "accounts", "orders", "payments", "subscriptions", "passwords",
    "shipments", "warranties", "returns", "coupons", "reviews", "contracts", "licenses",
    "bookings", "transfers", "gift cards", "reservations", "vouchers", "claims",
)  # fmt: skip
_TEAMS = (
    "Falcon", "Harbor", "Copper", "Meadow", "Granite", "Willow", "Orchid", "Summit",
    "Beacon", "Cedar", "Atlas", "Juniper",
)  # fmt: skip
_ROUTES = (
    "Rule {i}: Tickets about {topic} go to the {team} team.",
    "Rule {i}: Tickets about {topic} go to the {team} team, which replies within {h} hours.",
    "Rule {i}: Tickets about {topic} go to the {team} team unless the customer is a reseller.",
    "Rule {i}: Tickets about {topic} go to the {team} team; agents must not answer them directly.",
)
_FILLERS = (
    "Rule {i}: Refunds above {n} dollars need written approval from a shift manager.",
    "Rule {i}: Agents reply to every message about {topic} within {h} hours.",
    "Rule {i}: Never share details of {topic} by phone before verifying the customer's email.",
    "Rule {i}: Close a ticket only after the customer confirms the fix or {h} days pass.",
)


def _policy(rng: random.Random) -> SkillText:
    topics = [f"{a} {n}" for a in _ADJ for n in _NOUN]
    rng.shuffle(topics)
    units = []
    for i in range(MAX_UNITS):
        topic, h, n = topics[i], rng.randrange(2, 72), rng.randrange(50, 900)
        if i % 4 == 3:  # one rule in four says nothing about routing
            units.append(
                Unit(rng.choice(_FILLERS).format(i=i + 1, topic=topic, h=h, n=n), "", "", "")
            )
            continue
        team = rng.choice(_TEAMS)
        text = rng.choice(_ROUTES).format(i=i + 1, topic=topic, team=team, h=h)
        question = f"A customer writes about {topic}. Which team handles the ticket?"
        units.append(Unit(text, question, f"Tickets about {topic} go to the", f" {team}"))
    header = "ACME SUPPORT POLICY (version 7). Agents follow every rule below exactly.\n"
    return SkillText(
        "policy", header, tuple(units), "\n", "\nEnd of policy.", "Here is our support policy:"
    )


# -- passage ---------------------------------------------------------------------------

_HEADS = ("Bel", "Cor", "Dun", "Fal", "Gar", "Hol", "Kel", "Lor", "Mar", "Nor", "Ost", "Pel",
          "Quar", "Ros", "Sel", "Tor", "Val", "Wen", "Ash", "Bram")  # fmt: skip
_TAILS = ("brook", "mere", "ford", "ham", "wick", "stead", "holm", "by", "ton", "well", "dale",
          "haven", "moor", "field", "gate", "mouth", "ridge", "wood", "cliff", "port")  # fmt: skip
_PRODUCTS = ("copper", "wool", "salt", "timber", "cheese", "glass", "silk", "pottery", "honey",
             "tea", "marble", "leather", "paper", "cider", "linen", "tin")  # fmt: skip
_RIVERS = ("Arden", "Esk", "Lune", "Wye", "Tamar", "Ouse", "Teme", "Dove", "Nene", "Exe")
_SIZES = ("small", "market", "harbour", "hill", "mining", "river", "border", "cathedral")
_MONTHS = ("March", "April", "May", "June", "July", "August", "September", "October")
_FESTIVALS = ("lanterns", "bells", "kites", "boats", "bread", "music", "masks", "apples")
_FIRST = ("Ada", "Bruno", "Clara", "Dmitri", "Elena", "Farid", "Greta", "Hugo", "Ines", "Jonas")
_LAST = ("Varga", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Rossi", "Novak", "Hale", "Baptiste")


def _passage(rng: random.Random) -> SkillText:
    towns = [h + t for h in _HEADS for t in _TAILS]
    rng.shuffle(towns)
    units = []
    for town in towns[:MAX_UNITS]:
        product = rng.choice(_PRODUCTS)
        text = (
            f"{town} is a {rng.choice(_SIZES)} town on the {rng.choice(_RIVERS)} River, founded "
            f"in {rng.randrange(1050, 1890)}. Its economy rests on {product}, and every "
            f"{rng.choice(_MONTHS)} it holds a festival of {rng.choice(_FESTIVALS)}. The town "
            f"hall stands on {rng.choice(_FESTIVALS).title()} Street, and the mayor is "
            f"{rng.choice(_FIRST)} {rng.choice(_LAST)}."
        )
        question = f"According to the gazetteer, what does the economy of {town} rest on?"
        units.append(Unit(text, question, f"The economy of {town} rests on", f" {product}"))
    header = "GAZETTEER OF THE NORTHERN VALLEYS\n\n"
    return SkillText(
        "passage", header, tuple(units), "\n\n", "", "Here are the reference documents:"
    )


# -- tools -----------------------------------------------------------------------------

_VERBS = (
    "archive", "approve", "assign", "audit", "backup", "block", "book", "cancel", "charge",
    "clone", "close", "compare", "compress", "confirm", "convert", "count", "create",
    "decline", "decrypt", "delete", "deploy", "describe", "download", "duplicate", "edit",
    "email", "encrypt", "escalate", "estimate", "export", "fetch", "filter", "flag",
    "forecast", "format", "freeze", "generate", "grant", "import", "index", "inspect",
    "invite", "launch", "list", "locate", "lock", "match", "measure", "merge", "migrate",
    "monitor", "move", "notify", "open", "order", "pause", "pin", "print", "publish", "query",
    "rank", "rate", "read", "rebuild", "recover", "refund", "register", "reject", "reload",
    "remove", "rename", "render", "renew", "repair", "replace", "reply", "report", "reserve",
    "reset", "resize", "restore", "resume", "retry", "revoke", "rotate", "route", "scan",
    "schedule", "search", "send", "share", "sign", "sort", "split", "start", "stop", "submit",
    "summarize", "suspend", "sync", "tag", "track", "transfer", "translate", "unlock",
    "update", "upload", "validate", "verify", "watch",
)  # fmt: skip
_OBJECTS = (
    "invoice", "customer", "ticket", "order", "user", "report", "server", "file", "message",
    "meeting", "payment", "shipment", "contract", "device", "project", "task", "account",
    "certificate", "playlist", "dataset", "container", "calendar", "coupon", "document",
)  # fmt: skip
_SYSTEMS = ("billing", "CRM", "helpdesk", "storage", "inventory", "scheduling", "identity")
_EXTRA = (
    ("reason", "string", "Why the action is taken; kept in the audit log."),
    ("notify_owner", "boolean", "Whether the owner gets an email about it."),
    ("priority", "integer", "From 1 (lowest) to 5 (highest)."),
    ("note", "string", "Free text shown to the next agent."),
    ("dry_run", "boolean", "Only report what would change."),
)


def _tools(rng: random.Random) -> SkillText:
    verbs = list(_VERBS)
    rng.shuffle(verbs)
    units = []
    for i in range(MAX_UNITS):
        # One distinct verb per tool while they last: the name's first token picks the tool.
        verb, obj = verbs[i % len(verbs)], rng.choice(_OBJECTS)
        name = f"{verb}_{obj}" if i < len(verbs) else f"{verb}_{obj}_v{i // len(verbs) + 1}"
        extra = rng.choice(_EXTRA)
        schema = {
            "name": name,
            "description": f"{verb.capitalize()} a {obj} in the {rng.choice(_SYSTEMS)} system. "
            f"Use it when the user asks to {verb} a {obj}.",
            "parameters": {
                "type": "object",
                "properties": {
                    f"{obj}_id": {"type": "string", "description": f"ID of the {obj}."},
                    extra[0]: {"type": extra[1], "description": extra[2]},
                },
                "required": [f"{obj}_id"],
            },
        }
        question = f"Please {verb} the {obj} with id {rng.randrange(1000, 9999)}."
        units.append(Unit(json.dumps(schema), question, '<tool_call>\n{"name": "', name))
    header = "[\n"
    return SkillText("tools", header, tuple(units), ",\n", "\n]", "You can call these tools:")


_MAKERS: dict[Kind, Callable[[random.Random], SkillText]] = {
    "policy": _policy,
    "passage": _passage,
    "tools": _tools,
}


def skill_text(kind: Kind, seed: int) -> SkillText:
    """The units of ``kind`` for ``seed`` (the same on every machine)."""
    return _MAKERS[kind](random.Random(f"compose:{seed}:{kind}"))
