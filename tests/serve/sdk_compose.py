"""A two-turn chat through the SDK whose second turn carries a registered skill: shared by the
reference server's and the live SGLang server's compose tests."""

from __future__ import annotations

import uuid
from typing import Any

import openai

from leyline.policies import LeylineOpenAI
from leyline.policies.middleware_core import CallRecord
from leyline.policies.skills import SkillEntry, SkillLibrary
from leyline.protocol.client import LeylineClient


def chat_with_a_skill(
    base_url: str,
    api_key: str | None,
    model: str,
    text: str,
    *,
    skill_id: str,
    anchored: bool,
) -> tuple[SkillEntry, CallRecord]:
    """Register ``text`` as ``skill_id`` (``anchored``: compiled after the rendered context),
    then chat a turn, and a second one whose messages include the skill's message before a
    question; returns the skill's entry and the second turn's record."""
    library = SkillLibrary(LeylineClient(base_url, api_key=api_key), anchored=anchored)
    entry = library.register(skill_id, text, role="user")
    base = openai.OpenAI(base_url=base_url + "/v1", api_key=api_key or "none")
    client = LeylineOpenAI(base, session=f"sdk-{uuid.uuid4().hex[:8]}", skills=library)
    messages: list[Any] = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi."},
    ]
    first = client.chat.completions.create(
        model=model, messages=messages, max_tokens=3, temperature=0
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        library.message(skill_id),
        {"role": "user", "content": "What is 2+2?"},
    ]
    client.chat.completions.create(model=model, messages=messages, max_tokens=3, temperature=0)
    return entry, client.records[-1]
