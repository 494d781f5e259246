"""Every rejected request gets a typed 4xx and leaves the session exactly as it was."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from .conftest import MAX_BODY, MAX_DIRECTIVES, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

SESSION = "rejections"


@pytest.fixture(scope="module")
def session(server: Server) -> dict[str, Any]:
    with server.client() as http:
        created = http.post(
            "/leyline/v1/sessions",
            json={
                "session": SESSION,
                "messages": [{"role": "user", "content": "Count from one to twenty in words."}],
            },
        )
        assert created.status_code == 201, created.text
        return http.get(f"/leyline/v1/sessions/{SESSION}", params={"tokens": "true"}).json()


def splice(start: int, end: int, replacement: Any = "x") -> dict[str, Any]:
    return {"verb": "splice", "span": {"start": start, "end": end}, "replacement": replacement}


def apply_body(revision: int, directives: list[Any]) -> dict[str, Any]:
    return {"base_revision": revision, "directives": directives}


CASES: list[tuple[str, Any, int, str]] = [
    ("stale revision", lambda r, n: apply_body(r + 7, [splice(1, 2)]), 409, "revision_conflict"),
    ("reversed span", lambda r, n: apply_body(r, [splice(5, 2)]), 422, "invalid_span"),
    ("span past the end", lambda r, n: apply_body(r, [splice(2, n + 1)]), 422, "invalid_span"),
    (
        "overlap",
        lambda r, n: apply_body(r, [splice(1, 5), splice(4, 6)]),
        422,
        "overlapping_directives",
    ),
    (
        "unknown verb",
        lambda r, n: apply_body(r, [{"verb": "rewind", "span": {"start": 0, "end": 1}}]),
        422,
        "invalid_directive",
    ),
    (
        "extra field",
        lambda r, n: apply_body(r, [splice(1, 2) | {"mode": "forget"}]),
        422,
        "invalid_directive",
    ),
    (
        "pin with a negative ttl",
        lambda r, n: apply_body(r, [{"verb": "pin", "span": {"start": 0, "end": 1}, "ttl_s": -1}]),
        422,
        "invalid_directive",
    ),
    (
        "pin in a batch that fails later",
        lambda r, n: apply_body(r, [{"verb": "pin", "span": {"start": 0, "end": 1}}, splice(5, 2)]),
        422,
        "invalid_span",
    ),
    (
        "too many directives",
        lambda r, n: apply_body(r, [splice(i, i + 1) for i in range(MAX_DIRECTIVES + 1)]),
        413,
        "too_many_directives",
    ),
    (
        "token out of vocabulary",
        lambda r, n: apply_body(r, [splice(1, 2, [10**9])]),
        422,
        "invalid_directive",
    ),
    ("empty batch", lambda r, n: apply_body(r, []), 422, "empty_batch"),
    (
        "bad anchor",
        lambda r, n: apply_body(r, [{"verb": "splice", "span": {"message": 9}}]),
        422,
        "unresolved_anchor",
    ),
]


@pytest.mark.parametrize(("name", "make", "status", "code"), CASES, ids=[c[0] for c in CASES])
def test_bad_batches_are_typed_and_change_nothing(
    server: Server, session: dict[str, Any], name: str, make: Any, status: int, code: str
) -> None:
    with server.client() as http:
        body = make(session["revision"], session["num_tokens"])
        reply = http.post(f"/leyline/v1/sessions/{SESSION}/directives", json=body)
        assert reply.status_code == status, reply.text
        error = reply.json()["error"]
        assert error["code"] == code and error["message"], error
        after = http.get(f"/leyline/v1/sessions/{SESSION}", params={"tokens": "true"}).json()
    assert after == session


def test_bad_chat_requests_are_typed_and_change_nothing(
    server: Server, session: dict[str, Any]
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    rev = session["revision"]
    cases = [
        (
            {
                "messages": messages,
                "leyline": {
                    "session": SESSION,
                    "base_revision": rev,
                    "directives": [splice(0, 1)] * 2,
                },
            },
            422,
        ),
        (
            {"messages": messages, "leyline": {"session": SESSION, "directives": [splice(0, 1)]}},
            422,
        ),
        ({"messages": messages, "leyline": {"session": SESSION, "revison": 1}}, 422),
        (
            {
                "messages": messages,
                "leyline": {"session": SESSION, "options": {"infer_splices": True}},
            },
            422,
        ),
        ({"messages": [], "leyline": {"session": SESSION}}, 422),
        ({"messages": messages, "temperature": 9, "leyline": {"session": SESSION}}, 422),
        # A seed out of range is refused before the prompt is prefilled or the splice run.
        ({"messages": messages, "seed": 2**64, "leyline": {"session": SESSION}}, 422),
        (
            {
                "messages": messages,
                "seed": 2**64,
                "leyline": {"session": SESSION, "base_revision": rev, "directives": [splice(0, 1)]},
            },
            422,
        ),
        # An extension addressed to an old revision would overwrite another client's append.
        ({"messages": messages, "leyline": {"session": SESSION, "base_revision": rev + 1}}, 409),
        (
            {
                "messages": messages,
                "leyline": {
                    "session": "nobody",
                    "base_revision": rev,
                    "directives": [splice(0, 1)],
                },
            },
            404,
        ),
    ]
    with server.client() as http:
        for body, status in cases:
            reply = http.post("/v1/chat/completions", json={"model": "m", **body})
            assert reply.status_code == status, (body, reply.text)
            assert reply.json()["error"]["type"] == "leyline_error"
        after = http.get(f"/leyline/v1/sessions/{SESSION}", params={"tokens": "true"}).json()
    assert after == session


def test_rejected_creates_create_nothing(server: Server) -> None:
    with server.client() as http:
        cases = [
            ({"session": "too-long", "tokens": [1] * 8193}, 413, "session_too_long"),
            ({"session": "bad-id", "tokens": [1, 10**9]}, 422, "invalid_directive"),
        ]
        for body, status, code in cases:
            reply = http.post("/leyline/v1/sessions", json=body)
            assert reply.status_code == status, reply.text
            assert reply.json()["error"]["code"] == code
            gone = http.get(f"/leyline/v1/sessions/{body['session']}")
            assert gone.status_code == 404, gone.text
        chat = {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "seed": 2**64,
            "leyline": {"session": "not-created"},
        }
        assert http.post("/v1/chat/completions", json=chat).status_code == 422
        assert http.get("/leyline/v1/sessions/not-created").status_code == 404


def test_a_prompt_with_no_room_to_generate_changes_nothing(server: Server) -> None:
    """A prompt exactly at the session limit leaves no room for a token: refused up front
    (it used to be prefilled into the session first)."""
    with server.client() as http:
        made = http.post("/leyline/v1/sessions", json={"session": "at-cap", "tokens": [1, 2, 3]})
        assert made.status_code == 201, made.text
        before = http.get("/leyline/v1/sessions/at-cap", params={"tokens": "true"}).json()
        body = {
            "prompt": [1, 2, 3] + [5] * (8192 - 3),
            "max_tokens": 1,
            "leyline": {"session": "at-cap"},
        }
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["code"] == "session_too_long"
        after = http.get("/leyline/v1/sessions/at-cap", params={"tokens": "true"}).json()
    assert after == before


def test_oversize_body_unknown_session_and_missing_key(server: Server) -> None:
    with server.client() as http:
        big = http.post("/v1/completions", json={"prompt": "x" * (MAX_BODY + 10)})
        assert big.status_code == 413 and big.json()["error"]["code"] == "limit_exceeded"
        gone = http.get("/leyline/v1/sessions/never-made")
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_session"
    anonymous = httpx.get(f"{server.base_url}/leyline/v1/capabilities")
    assert anonymous.status_code == 401
    assert anonymous.json()["error"]["code"] == "unauthorized"
    assert httpx.get(f"{server.base_url}/health").status_code == 200
