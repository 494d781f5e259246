"""Tenants on the plugin, as on ``leyline serve --api-keys-file``.

``make sglang-live-check`` and ``make vllm-live-check`` run this file against their servers
without keys (one tenant: capabilities say so) and against one started with
``LEYLINE_API_KEYS_FILE`` (two tenants: keys checked where the plugin answers, sessions,
skills where COMPOSE is offered, and KV per tenant, nothing of one tenant reused by the
other or by a plain request to the host).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from leyline.protocol.resources import Routes

from ._live import generate, prompt_text
from ._plain import plain_hit

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

KEYS = os.environ.get("LEYLINE_API_KEYS_FILE", "")


def _keys() -> dict[str, str]:
    pairs = (line.split() for line in Path(KEYS).read_text().splitlines() if line.strip())
    return {tenant: key for tenant, key in pairs}


def _turn(server: httpx.Client, key: str, session: str, tokens: list[int]) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": 1, "temperature": 0, "leyline": {"session": session}}
    return server.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def test_tenants_are_as_configured(server: httpx.Client, reference: Engine, page: int) -> None:
    if not KEYS:
        # No keys: one tenant, said so; sessions are the public namespace's.
        assert server.get(Routes.capabilities).json()["tenants"] is False
        return
    keys = _keys()
    alpha, bravo = (
        {"Authorization": f"Bearer {keys[t]}"} for t in ("alpha", "bravo")
    )  # fmt: skip
    refused = server.get(Routes.capabilities)
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
    capabilities = server.get(Routes.capabilities, headers=alpha).json()
    assert capabilities["tenants"] is True
    tokens = list(reference.encode(prompt_text("tenants")))

    # Alpha's session: its turn and its KV are alpha's.
    name = f"t-{uuid.uuid4().hex[:8]}"
    first = _turn(server, keys["alpha"], name, tokens)
    assert first.status_code == 200, first.text
    again = _turn(server, keys["alpha"], name, tokens)
    assert again.json()["leyline"]["reused_tokens"] >= plain_hit(len(tokens), page)  # its own
    # Bravo sees neither the session nor the KV; a plain request finds none of it either.
    gone = server.get(Routes.session.format(session=name), headers=bravo)
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"
    other = _turn(server, keys["bravo"], f"t-{uuid.uuid4().hex[:8]}", tokens)
    assert other.status_code == 200 and other.json()["leyline"]["reused_tokens"] == 0
    assert generate(server, tokens).cached_tokens == 0
    # A chat or completion with a leyline object needs a key too; a plain one is the host's.
    assert _turn(server, "not-a-key-of-anyone", name, tokens).status_code == 401

    # Skills are per tenant, where COMPOSE is offered.
    skill = {"skill": "rules", "tokens": tokens[:24]}
    if "compose" not in capabilities["verbs"]:
        refused = server.post(Routes.skills, json=skill, headers=alpha)
        assert refused.json()["error"]["code"] == "unsupported_verb", refused.text
        return
    assert server.post(Routes.skills, json=skill, headers=alpha).status_code == 201
    unknown = server.get(Routes.skill.format(skill="rules"), headers=bravo)
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "unknown_skill"
    assert server.delete(Routes.skill.format(skill="rules"), headers=alpha).status_code == 204
