"""The session around a skill: a system prompt and some conversation before it (the prefix,
ending where the skill is composed), and the question after it.

SmolLM2's chat format. The skill is the body of a user turn that the prefix opens, so the
question goes on in the same turn and the assistant's reply is opened up to the answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .texts import SkillText, Unit

_SYSTEMS = (
    "You are a careful assistant for ACME Corp. Answer from the material the user gives "
    "you, briefly.",
    "You are ACME's support copilot. Be exact; quote names as they are written.",
    "You are a helpful assistant. Use the provided material; if it does not say, say so.",
)
_TURNS = (
    (
        "Hi, I have a few questions for you today, mostly about our internal material.",
        "Of course. Send them over one at a time and I will answer from what you share.",
    ),
    (
        "Yesterday the dashboard showed twice the usual number of open tickets. Is that "
        "something I should worry about before the weekly review?",
        "A spike like that usually comes from one batch of similar requests. Check whether "
        "most of them share a topic before you bring it to the review.",
    ),
    (
        "Can you remind me how to write a short summary for a manager who has no time?",
        "Lead with the decision you need, then one line of context and one line of risk. "
        "Keep the details in an attachment they can skip.",
    ),
    (
        "My colleague keeps forwarding me messages that belong to another group. How do I "
        "push back politely?",
        "Reply once with the right contact and a short note that you will route the next "
        "ones there directly. Most people only need to hear it once.",
    ),
    (
        "We are moving offices next month and everything is a bit chaotic.",
        "Moves are hard. Keep a list of what must keep working on the first day and check "
        "it the evening before.",
    ),
    (
        "Is it better to answer a customer fast or to answer them completely?",
        "Completely, if it takes less than a day. A fast answer that needs a correction "
        "costs more trust than a short wait.",
    ),
    (
        "I tried to look this up earlier but the search tool returned nothing useful.",
        "Then paste the material here and I will read it for you.",
    ),
    (
        "Quick one before my meeting, and then a longer one after lunch.",
        "Go ahead with the quick one.",
    ),
)


@dataclass(frozen=True, slots=True)
class Context:
    prefix: str
    """Everything before the skill: system prompt, conversation, the opening of a user turn."""
    question: str
    """Everything after it: the question, the end of the turn, the assistant's reply so far."""
    answer: str


def make_context(
    skill: SkillText, unit: Unit, rng: random.Random, earlier_turns: int = 0
) -> Context:
    """A context asking ``unit``'s question, its prefix drawn from ``rng``; with
    ``earlier_turns`` more exchanges before the last few, drawn after them, so that the same
    ``rng`` state gives the same recent conversation at every depth."""
    turns = rng.sample(_TURNS, rng.randrange(3, 6))
    system = rng.choice(_SYSTEMS)
    turns = [rng.choice(_TURNS) for _ in range(earlier_turns)] + turns
    chat = "".join(
        f"<|im_start|>user\n{u}<|im_end|>\n<|im_start|>assistant\n{a}<|im_end|>\n" for u, a in turns
    )
    prefix = f"<|im_start|>system\n{system}<|im_end|>\n{chat}<|im_start|>user\n{skill.intro}\n"
    question = f"\n\n{unit.question}<|im_end|>\n<|im_start|>assistant\n{unit.stub}"
    return Context(prefix, question, unit.answer)
