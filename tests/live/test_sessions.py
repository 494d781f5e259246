"""The backend's ``/leyline/v1`` resources on a live server, and ``leyline conformance``."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import TYPE_CHECKING

import httpx

from leyline.protocol.resources import Routes

from ._live import apply, create_session, generate, plain_hit, prompt_text, session_tokens

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def test_session_create_get_delete(server: httpx.Client, reference: Engine) -> None:
    text = prompt_text("session")
    name = f"live-{uuid.uuid4().hex[:10]}"
    reply = server.post(Routes.sessions, json={"text": text, "session": name})
    assert reply.status_code == 201, reply.text
    assert reply.json()["session"] == name
    tokens, revision = session_tokens(server, name)
    assert tokens == list(reference.encode(text)) and revision == reply.json()["revision"]
    info = server.get(Routes.session.format(session=name)).json()
    assert info["tokens"] is None and info["num_tokens"] == len(tokens)
    assert server.delete(Routes.session.format(session=name)).status_code == 204
    gone = server.get(Routes.session.format(session=name))
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"


def test_stale_revision_is_409(server: httpx.Client, reference: Engine) -> None:
    tokens = list(reference.encode(prompt_text("revision")))
    session, base = create_session(server, tokens)
    cut = [{"verb": "splice", "span": {"start": 10, "end": 20}}]
    assert apply(server, session, base, cut).status_code == 200
    after = session_tokens(server, session)
    stale = apply(server, session, base, cut)
    assert stale.status_code == 409, stale.text
    assert stale.json()["error"]["code"] == "revision_conflict"
    assert session_tokens(server, session) == after  # nothing changed


def _cached(server: httpx.Client, tokens: list[int], salt: str | None) -> int:
    """How many prompt tokens a plain request (with the host's ``cache_salt``) found."""
    return generate(server, tokens, salt).cached_tokens


def test_a_cache_salt_partitions_the_cache_as_the_hosts_own(
    server: httpx.Client, reference: Engine, page: int
) -> None:
    """A session made with a ``cache_salt`` shares its KV with the requests that carry the
    same salt (the host's own plain route included) and with nobody else."""
    assert server.get(Routes.capabilities).json()["cache_salt"] is True
    # Four random leading ids: no other prompt's path in the public tree starts this way.
    lead = [int(uuid.uuid4().int % 40_000) + 1_000 for _ in range(4)]
    tokens = lead + list(reference.encode(prompt_text("salt")))
    salt = f"team-{uuid.uuid4().hex[:8]}"
    reply = server.post(Routes.sessions, json={"tokens": tokens, "cache_salt": salt})
    assert reply.status_code == 201, reply.text
    assert _cached(server, tokens, None) <= 1  # a leading id may coincide, not two
    assert _cached(server, tokens, f"{salt}-other") == 0
    assert _cached(server, tokens, salt) == plain_hit(len(tokens), page)


def test_capabilities_list_compose_with_anchors(server: httpx.Client) -> None:
    """Both backends execute COMPOSE (anchored skills too) and serve the skills routes."""
    caps = server.get(Routes.capabilities).json()
    assert {"compose", "splice"} <= set(caps["verbs"]) and caps["skill_anchors"] is True, caps


def test_conformance(url: str) -> None:
    """``leyline conformance URL`` itself, unchanged: every check passes."""
    command = [sys.executable, "-m", "leyline.cli.main", "conformance", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
