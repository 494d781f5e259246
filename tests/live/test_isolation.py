"""Approximate KV serves only the session that made it (issue 45; protocol 3.1, 3.2, 3.4).

A splice keeps the downstream KV, which still attended to the removed span: that is what
AMORTIZE means, for the session that asked. Nobody else may be served it: not a plain
request for the same edited tokens (no ``leyline`` field), not another session that
FORGETs the same span, not after the splicing session is deleted. Each of them must get
the exact prefill of the edited tokens, measured against the reference engine's prefill
of those tokens from scratch; a batch must equal its definition (the reference engine's
batch). The mutant control builds splices in the shared namespace (the live shim's
switch) and must fail the same comparison: the check can fail.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.resources import Routes

from ._live import (
    TOLERANCE,
    built_logprobs,
    directive,
    edited_session,
    floor_page,
    generate,
    max_delta,
    prompt_text,
    record,
    reference_logprobs,
    session_generate,
    session_tokens,
    switched_on,
)

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

CUT = 40
STUB = " [tool output removed]"
SHARED_SPLICE_FLAG = "LEYLINE_LIVE_SHARED_SPLICE_FLAG"


def _edited(server: httpx.Client, tokens: list[int], edits: list[Edit]) -> dict[str, Any]:
    session, _, body = edited_session(server, tokens, [directive(e) for e in edits])
    return {"session": session, **body}


def _scenario(reference: Engine, tag: str) -> tuple[list[int], Edit, list[int]]:
    tokens = list(reference.encode(prompt_text(tag)))
    start = len(tokens) // 3
    edit = Edit(start, start + CUT, tuple(reference.encode(STUB)))
    new = tokens[:start] + list(edit.replacement) + tokens[edit.end :]
    return tokens, edit, new


def _strangers(
    server: httpx.Client, reference: Engine, tag: str
) -> tuple[Edit, dict[str, float], dict[str, Any]]:
    """Session P splices; then a plain request and session Q's FORGET of the same span."""
    tokens, edit, new = _scenario(reference, tag)
    spliced = _edited(server, tokens, [edit])
    assert spliced["path"] == "splice" and spliced["rotated_tokens"] > 0, spliced
    exact = reference_logprobs(reference, new)
    own = session_generate(server, spliced["session"], new)
    # The plain request first: it must not find P's KV (only the exact prefix). Then Q,
    # whose forget re-prefills in the shared namespace: its own distribution, by a turn.
    plain = generate(server, new)
    forget = Edit(edit.start, edit.end, edit.replacement, Mode.forget)
    forgot = _edited(server, tokens, [forget])
    assert forgot["path"] == "reprefill" and forgot["reused_tokens"] <= edit.start, forgot
    q = session_generate(server, forgot["session"], new)
    deltas = {
        "plain_request": max_delta(plain.top, exact),
        "other_session_forget": max_delta(q.top, exact),
        "the_splice_itself": max_delta(own.top, exact),
    }
    return edit, deltas, {"plain_cached": plain.cached_tokens}


def test_nobody_else_is_served_a_sessions_spliced_kv(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    edit, deltas, facts = _strangers(server, reference, "isolation")
    record(report_path, check="isolation: a stranger after a splice", **deltas, **facts)
    assert facts["plain_cached"] <= floor_page(edit.start, page), facts  # the exact prefix
    assert deltas["plain_request"] <= TOLERANCE
    assert deltas["other_session_forget"] <= TOLERANCE
    # The splice itself is AMORTIZE-approximate: it must differ, or this proves nothing.
    assert deltas["the_splice_itself"] > 10 * TOLERANCE, deltas


def test_a_deleted_sessions_namespace_serves_nobody(
    server: httpx.Client, reference: Engine
) -> None:
    tokens, edit, new = _scenario(reference, "deleted")
    spliced = _edited(server, tokens, [edit])
    assert spliced["path"] == "splice", spliced
    session_generate(server, spliced["session"], new)  # a turn caches more of its own
    assert server.delete(f"/leyline/v1/sessions/{spliced['session']}").status_code == 204
    plain = generate(server, new)
    assert plain.cached_tokens <= edit.start
    assert max_delta(plain.top, reference_logprobs(reference, new)) <= TOLERANCE


@pytest.mark.backends("vllm")
def test_a_plain_request_cannot_name_a_private_namespace(server: httpx.Client) -> None:
    """The backend's private salts are reserved: a plain body or a session naming one is
    refused (422, ``cache_salt``); any other salt passes to vLLM."""
    salt = "leyline-session-0123456789abcdef0123456789abcdef"
    body = {"prompt": [1, 2, 3], "max_tokens": 1, "cache_salt": salt}
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 422, reply.text
    assert reply.json()["error"]["field"] == "cache_salt"
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "cache_salt": salt}
    assert server.post("/v1/chat/completions", json=chat).status_code == 422
    session = server.post(Routes.sessions, json={"tokens": [1, 2], "cache_salt": salt})
    assert session.status_code == 422, session.text
    assert generate(server, [1, 2, 3], salt="mine").prompt_tokens == 3


@pytest.mark.parametrize(
    "shape",
    ["forget-then-splice", "splice-then-forget", "rewrite-and-stub"],
)
def test_batches_equal_their_definition(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None, shape: str
) -> None:
    """Each batch on a fresh session vs the reference engine's batch (or, where the server
    reports a fallback, what that fallback means: ``_built``); then a stranger's plain
    request for the result vs its exact prefill."""
    tokens = list(reference.encode(prompt_text(f"batch-{shape}")))
    n, stub = len(tokens), tuple(reference.encode(STUB))
    a, b = n // 4, n // 2
    edits = {
        "forget-then-splice": [Edit(a, a + 20, (), Mode.forget), Edit(b, b + 30, stub)],
        "splice-then-forget": [Edit(a, a + 20, stub), Edit(b, b + 30, (), Mode.forget)],
        "rewrite-and-stub": [Edit(a, a + 10, stub + stub), Edit(b, b + 30, stub)],
    }[shape]
    done = _edited(server, tokens, edits)
    new = session_tokens(server, done["session"])[0]
    own = session_generate(server, done["session"], new)
    fallback = done["fallback_reason"]  # checked by _built: a fallback it has no model of fails
    delta = max_delta(own.top, built_logprobs(reference, tokens, edits, fallback))
    plain = generate(server, new)
    stranger = max_delta(plain.top, reference_logprobs(reference, new))
    record(report_path, check=f"batch {shape}", max_delta_logprob=delta,
           stranger_delta=stranger, response_path=done["path"], fallback=fallback)  # fmt: skip
    assert delta <= TOLERANCE
    assert stranger <= TOLERANCE


def test_a_mutant_that_shares_spliced_kv_fails_the_check(
    server: httpx.Client, reference: Engine, page: int, report_path: Path | None
) -> None:
    """Negative control: with splices built in the shared namespace (the live shim's
    switch), a stranger is served the spliced KV and the comparison must fail."""
    how = (
        "start the server with it (live_server.sh does, from live_check.sh) and pass the "
        "same value here"
    )
    with switched_on(SHARED_SPLICE_FLAG, how):
        edit, deltas, facts = _strangers(server, reference, "mutant")
    record(report_path, check="isolation, MUTANT (shared splice): must fail", **deltas, **facts)
    assert facts["plain_cached"] > floor_page(edit.start, page), (
        f"with the mutant on, a plain request still found only {facts['plain_cached']} "
        "cached tokens: the switch had no effect; is the leyline_live_shims plugin loaded?"
    )
    assert deltas["other_session_forget"] > 10 * TOLERANCE, deltas
    assert deltas["plain_request"] > 10 * TOLERANCE, deltas
