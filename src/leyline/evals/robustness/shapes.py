"""Near-valid bodies of every request shape, addressed to a session's live state.

Each builder starts from what a real client sends (the protocol's request models) and
bends one part: spans in and out of range, stale or future revisions, anchors to messages
that do or do not exist, token ids outside the vocabulary, seeds past 64 bits, and so on.
Generation stays tiny (``max_tokens`` 1-2) so that accepted requests cost little.
"""

from __future__ import annotations

from typing import Any

from .source import Source, below, chance, pick
from .values import TEXTS, nasty

View = dict[str, Any]
"""A session as ``GET /leyline/v1/sessions/{id}?tokens=true`` returns it."""

CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Look up order 17."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "lookup", "arguments": '{"order": 17}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "order 17: shipped"},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look up an order.",
            "parameters": {"type": "object", "properties": {"order": {"type": "integer"}}},
        },
    }
]
HUGE = (2**63, 2**64, 2**70, 10**30)
SKILLS = ("fz-skill", "fz-skill-2")
"""Skill ids the fuzz registers and deletes (``fz-skill`` is kept registered by the checks)."""


def revision(source: Source, view: View | None) -> Any:
    """The revision a write addresses: mostly current; else stale, future, or not one."""
    current = view["revision"] if view else 0
    if not chance(source, 40):
        return current
    return pick(source, (current - 1, current + 1, 0, -1, *HUGE, "1", 1.5, None))


def token_span(source: Source, length: int) -> dict[str, Any]:
    a, b = sorted((below(source, length + 1), below(source, length + 1)))
    if not chance(source, 40):
        return {"start": a, "end": b}
    start, end = pick(
        source,
        (
            (a, a),  # an insertion
            (length, length),
            (0, length),
            (length, length + 1),  # past the end
            (b + 1, a),  # reversed (or a no-op)
            (-1, b),
            (a, 2**70),
            (2**63, 2**64),
        ),
    )
    return {"start": start, "end": end}


def anchor(source: Source, view: View | None) -> dict[str, Any]:
    messages = len(view["spans"]) if view else 0
    index: object = below(source, messages)
    part: object = pick(source, ("all", "content", "tool_calls", None))
    if chance(source, 30):
        index = pick(source, (messages, -1, 2**70, "0"))
        part = pick(source, (part, "header", 3))
    return {"message": index} if part is None else {"message": index, "part": part}


def span(source: Source, view: View | None) -> Any:
    length = view["num_tokens"] if view else 0
    kind = source.integer(0, 9)
    if kind <= 5:
        return token_span(source, length)
    if kind <= 7:
        return anchor(source, view)
    if kind == 8:
        return {"start": 0, "end": 1, "message": 0}  # both kinds at once
    return nasty(source)


def replacement(source: Source, limit: int) -> Any:
    kind = source.integer(0, 9)
    if kind == 0:
        return pick(source, ("", "x", " [redacted]"))
    if kind == 1:
        return pick(source, TEXTS)
    if kind == 2:
        return [source.integer(0, 49151) for _ in range(source.integer(0, 4))]
    if kind == 3:
        return pick(source, ([10**9], [-1], [2**70], [1.5], ["7"], [[1]]))
    if kind == 4:
        return [7] * (limit + 1)  # one past max_replacement_tokens
    if kind == 5:
        return nasty(source)
    return pick(source, ("", "x", " [redacted]"))


def insertion_point(source: Source, view: View | None) -> Any:
    length = view["num_tokens"] if view else 0
    kind = source.integer(0, 5)
    if kind <= 2:
        return below(source, length + 1)
    if kind == 3:
        return "end"
    if kind == 4:
        point = anchor(source, view) | {"edge": pick(source, ("start", "end", "middle"))}
        return point
    return pick(source, (length + 1, -1, 2**70, "start", None, 1.5))


def compose(source: Source, view: View | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "verb": "compose",
        "skill": pick(source, (*SKILLS, "nope", "", "x" * 129)),
        "at": insertion_point(source, view),
    }
    if chance(source, 60):
        body["seam_tokens"] = pick(source, (0, 4, 16, 256, 257, -1, "4"))
    if chance(source, 30):
        body["recompute"] = pick(
            source,
            (
                {"mode": "none"},
                {"mode": "deviation", "ratio": 0.15},
                {"mode": "deviation", "ratio": 0},
                {"mode": "attention", "ratio": 0.3},
                {"mode": "attention", "ratio": 1.5},
                {"mode": "bogus"},
                {"mode": "none", "ratio": 0.5},
            ),
        )
    return body


def retention(source: Source, verb: str, view: View | None, limit: int) -> dict[str, Any]:
    """A pin, unpin, decay or scratch: mostly a valid mark, else one field bent."""
    body: dict[str, Any] = {"verb": verb, "span": span(source, view)}
    if verb == "pin" and chance(source, 50):
        body["ttl_s"] = pick(source, (0.5, 30, 0, -1, 10**9, "x", float("nan")))
    if verb in ("decay", "scratch"):
        if chance(source, 50):
            body["mode"] = pick(source, ("forget", "amortize", "shred"))
        if chance(source, 40):
            body["replacement"] = replacement(source, limit)
    if verb == "decay" and chance(source, 50):
        body["priority"] = pick(source, (0, 3, 1_000_000, 1_000_001, -1, 2.5))
    return body


def directive(source: Source, view: View | None, limit: int) -> dict[str, Any]:
    verb: str | None = pick(source, ("splice", "forget", "erratum"))
    if chance(source, 15):
        verb = pick(source, ("compose", "pin", "unpin", "decay", "scratch", "rewind", None))
    if verb in ("splice", "forget"):
        body: dict[str, Any] = {"verb": verb, "span": span(source, view)}
        if chance(source, 80):
            body["replacement"] = replacement(source, limit)
        return body
    if verb == "erratum":
        text = " [STATE UPDATE] x -> 1." if not chance(source, 20) else pick(source, ("", 5))
        body = {"verb": verb, "text": text}
        if chance(source, 30):
            body["corrects"] = span(source, view)
        return body
    if verb == "compose":
        return compose(source, view)
    if verb is None:
        return {"span": span(source, view)}
    if verb == "rewind":
        return {"verb": verb, "span": span(source, view), "mode": "forget"}
    return retention(source, verb, view, limit)


def skill_create(source: Source) -> dict[str, Any]:
    """A skill registration: one source (text, tokens or messages), or a bent body."""
    body: dict[str, Any] = {}
    if chance(source, 80):
        body["skill"] = pick(source, (*SKILLS, "", "x" * 129, 5))
    kind = source.integer(0, 6)
    if kind <= 1:
        body["text"] = pick(source, ("Rule 1: be brief.", "", "数据 😀"))
    elif kind == 2:
        body["tokens"] = pick(source, ([1, 2, 3], [], [10**9], [-1], [7] * 4097))
    elif kind == 3:
        body["messages"] = CONVERSATION[:2]
    elif kind == 4:
        body |= {"text": "a", "tokens": [1]}  # two sources at once
    elif kind == 5:
        body |= {"text": "policy", "model": pick(source, ("other-model", "", 3))}
    if chance(source, 20):
        body["name"] = pick(source, ("rules", "x" * 300, 7))
    if chance(source, 25):
        body["anchor"] = skill_anchor(source)
    return body


def skill_anchor(source: Source) -> Any:
    """A skill's anchor: near-valid (one source) or bent (none, two, out of range, long)."""
    return pick(
        source,
        (
            {"tokens": [1, 2]},
            {"text": "You are terse."},
            {"messages": CONVERSATION[:1]},
            {"tokens": [10**9]},
            {"tokens": [7] * 4097},
            {"text": "a", "tokens": [1]},
            {},
            {"text": ""},
            "template",
            None,
        ),
    )


def directives(source: Source, view: View | None, max_directives: int, limit: int) -> Any:
    count = pick(source, (1, 1, 1, 1, 2, 2, 3, 0, max_directives + 1))
    if count == max_directives + 1:  # many copies of one cheap directive
        return [{"verb": "erratum", "text": "."}] * count
    batch = [directive(source, view, limit) for _ in range(count)]
    widths = [source.integer(0, 1) for _ in batch]
    disjoint = chance(source, 50)  # drawn whatever the state (see source.py)
    if count > 1 and view and disjoint:  # disjoint spans, in order: often valid
        step = max(view["num_tokens"] // count, 1)
        for i, item in enumerate(batch):
            if item.get("verb") in ("splice", "forget"):
                item["span"] = {"start": i * step, "end": i * step + widths[i]}
    return batch


def options(source: Source) -> dict[str, Any]:
    return pick(
        source,
        (
            {},
            {"allow_fallback": False},
            {"allow_fallback": True},
            {"infer_splices": True},
            {"allow_fallback": "no"},
            {"speed": 1},
        ),
    )


def apply_body(source: Source, view: View | None, max_directives: int, limit: int) -> Any:
    body: dict[str, Any] = {"directives": directives(source, view, max_directives, limit)}
    if (base := revision(source, view)) is not None:
        body["base_revision"] = base
    if chance(source, 20):
        body["options"] = options(source)
    return body


def messages(source: Source, view: View | None) -> list[dict[str, Any]]:
    """The session's conversation and a new turn (an extension), or a short fresh one."""
    turn = {"role": "user", "content": pick(source, ("ok?", "Say one word.", *TEXTS[2:]))}
    kind = source.integer(0, 3)
    if kind == 0:
        return [turn]
    if kind == 1:
        return [*CONVERSATION, turn]
    if kind == 2:
        return [{"role": pick(source, ("user", "system", "tool", "robot")), "content": "hi"}]
    return [{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image"}]}]


def leyline(source: Source, session: str | None, view: View | None, limits: Any) -> Any:
    body: dict[str, Any] = {} if session is None else {"session": session}
    if chance(source, 35) and (base := revision(source, view)) is not None:
        body["base_revision"] = base
    if chance(source, 30):
        body["directives"] = directives(source, view, *limits)
    if chance(source, 10):
        body["options"] = options(source)
    return body


def sampling(source: Source) -> dict[str, Any]:
    """Sampling fields: mostly valid, sometimes out of range (seeds up to 2**70)."""
    fields: dict[str, Any] = {"max_tokens": pick(source, (1, 2, 1, 0, -1, "1", 1.5))}
    extra = source.integer(0, 9)
    if extra == 1:
        fields["seed"] = pick(source, (0, 2**63 - 1, 2**64 - 1, 2**64, -(2**63), 2**70, -(2**70)))
        fields["temperature"] = pick(source, (0.7, 0, 2, 2.5, -1))
    elif extra == 2:
        fields["top_p"] = pick(source, (0.9, 1, 0, 1.5))
    elif extra == 3:
        fields["stop"] = pick(source, ("\n", ["a", "b"], [], [""], 5))
    elif extra == 4:
        fields["stream"] = True
        if chance(source, 50):
            fields["stream_options"] = {"include_usage": True}
    elif extra == 5:
        fields["n"] = pick(source, (1, 2))
        fields["cache_salt"] = pick(source, ("s1", "", "x" * 300))
    elif extra == 6:
        # A valid huge budget would generate to the session limit: only invalid ones here.
        fields["max_completion_tokens"] = pick(source, (1, 0, -5, "2"))
    elif extra == 7:
        fields["logprobs"] = pick(source, (True, 3, 21, -1))
        fields["top_logprobs"] = pick(source, (2, 20, 21, 2**70))
    return fields
