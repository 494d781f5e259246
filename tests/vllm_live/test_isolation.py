"""Approximate KV serves only the session that made it: after session P splices, a plain
request for the same edited tokens (vLLM's own route, no ``leyline`` object) gets the exact
prefill, hitting at most the blocks of the unchanged prefix; a plain request cannot name a
private namespace (422)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from leyline.protocol.algebra import Edit
from leyline.protocol.resources import Routes
from tests.sglang_live._live import (
    TOLERANCE,
    directive,
    edited_session,
    max_delta,
    prompt_text,
    record,
    reference_logprobs,
    session_generate,
)

from ._live import generate

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

CUT = 40


def test_a_plain_request_never_hits_the_spliced_kv(
    server: httpx.Client, reference: Engine, block_size: int, report_path: Path | None
) -> None:
    tokens = list(reference.encode(prompt_text("isolation")))
    start = len(tokens) // 3
    edit = Edit(start, start + CUT, ())
    session, _, body = edited_session(server, tokens, [directive(edit)])
    assert body["path"] == "splice" and body["rotated_tokens"] > 0, body
    new = tokens[:start] + tokens[edit.end :]
    own = session_generate(server, session, new)
    plain = generate(server, new)
    exact = reference_logprobs(reference, new)
    deltas = {
        "plain_request": max_delta(plain.top, exact),
        "the_splice_itself": max_delta(own.top, exact),
    }
    record(report_path, check="isolation", plain_cached=plain.cached_tokens, **deltas)
    assert plain.cached_tokens <= start - start % block_size  # the exact prefix only
    assert deltas["plain_request"] <= TOLERANCE
    assert deltas["the_splice_itself"] > 10 * TOLERANCE  # the spliced KV differs: a real check


def test_reserved_salts_are_refused(server: httpx.Client) -> None:
    salt = "leyline-session-0123456789abcdef0123456789abcdef"
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": salt}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "cache_salt"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt}
    assert server.post("/v1/chat/completions", json=chat).status_code == 422
    session = server.post(Routes.sessions, json={"tokens": [1, 2], "cache_salt": salt})
    assert session.status_code == 422, session.text
    assert generate(server, [1, 2, 3], cache_salt="mine").prompt_tokens == 3  # others pass


def test_capabilities_leave_compose_out(server: httpx.Client) -> None:
    caps = server.get(Routes.capabilities).json()
    assert "compose" not in caps["verbs"] and "splice" in caps["verbs"], caps
    skill = server.post(Routes.skills, json={"tokens": [1, 2, 3]})
    assert skill.status_code >= 400 and skill.json()["error"]["code"] == "unsupported_verb"
