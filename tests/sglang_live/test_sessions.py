"""The plugin's ``/leyline/v1`` resources on a live server, and ``leyline conformance``."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING

import httpx

from leyline.protocol.resources import Routes

from ._live import apply, create_session, prompt_text, session_tokens

if TYPE_CHECKING:
    from leyline.server_adapter.engine import Engine


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


def test_conformance() -> None:
    """``leyline conformance URL`` itself, unchanged: every check passes."""
    url = os.environ["LEYLINE_SGLANG_URL"]
    command = [sys.executable, "-m", "leyline.cli.main", "conformance", url]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr[-3000:]}"
