"""The fuzzer: one request at a time, to any route, near-valid or garbage.

Requests name sessions from a small pool (two that usually exist, two that usually do
not), so that every state check has a known "before". The weights keep model work (an
accepted chat, completion or directive batch) to under a fifth of the requests.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any
from urllib.parse import quote

from leyline.protocol.routing import ENVELOPE_PATH, envelope_body

from . import shapes
from .source import Source, chance, pick
from .values import encode, garbage, mutate

BASE_SESSIONS = ("fz-0", "fz-1")
"""Kept alive (the checks recreate them when gone or long): directives need a target."""
NEW_SESSIONS = ("fz-new", "fz ü")
"""Usually absent: a rejected request must not create them."""
POOL = BASE_SESSIONS + NEW_SESSIONS
ODD_PATH_IDS = ("%ED%A0%80", "..", "%00", "a" * 300, "%2F", "%25")
ROUTES = (
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
    ("GET", "/v1/models"),
    ("GET", "/leyline/v1/capabilities"),
    ("GET", "/leyline/v1/schema"),
    ("POST", "/leyline/v1/sessions"),
    ("GET", "/leyline/v1/sessions/{id}"),
    ("DELETE", "/leyline/v1/sessions/{id}"),
    ("POST", "/leyline/v1/sessions/{id}/directives"),
    ("POST", "/leyline/v1/tokenize"),
    ("POST", "/leyline/v1/detokenize"),
    ("POST", "/leyline/v1/skills"),
    ("GET", "/leyline/v1/skills"),
    ("GET", "/leyline/v1/skills/{skill}"),
    ("DELETE", "/leyline/v1/skills/{skill}"),
)
SKILL_ROUTES = ("/leyline/v1/skills", "/leyline/v1/skills/{skill}")
Views = Mapping[str, shapes.View | None]


def session_path(session: str) -> str:
    return f"/leyline/v1/sessions/{quote(session, safe='')}"


def skill_path(skill: str) -> str:
    return f"/leyline/v1/skills/{quote(skill, safe='')}"


CHEAP_PREFILL = 1024
"""A prompt of exactly ``max_session_tokens`` is sent only when it is at most this long."""


@dataclass(frozen=True, slots=True)
class Limits:
    max_directives: int
    max_replacement_tokens: int
    max_body_bytes: int
    max_session_tokens: int

    def edge_prompts(self) -> tuple[list[int], ...]:
        """Prompts at and one past the session limit (at it, nothing is left to generate)."""
        cap = self.max_session_tokens
        past = [7] * (cap + 1)
        return ([7] * cap, past) if cap <= CHEAP_PREFILL else (past,)


@dataclass(frozen=True, slots=True)
class Call:
    """One request as it goes on the wire, and what the checks need to know about it."""

    method: str
    path: str
    route: str
    """The route template (``/leyline/v1/sessions/{id}``), for the per-route histogram."""
    body: bytes | None = None
    session: str | None = None
    """The pool session the request names (path or body), whose state is checked."""
    auth: str = "key"
    """``key`` (the tenant's), ``none`` or ``wrong``."""
    label: str = ""

    def reproducer(self) -> str:
        body = "" if self.body is None else f" body={self.body[:2000]!r}"
        return f"{self.method} {self.path} auth={self.auth}{body}"


def is_leyline_request(call: Call) -> bool:
    """A request Leyline answers on any host: its routes, or a body with a ``leyline``."""
    if call.path.startswith("/leyline/v1"):
        return True
    try:
        body = json.loads(call.body or b"")
    except ValueError:
        return False
    return isinstance(body, dict) and "leyline" in body


def enveloped(call: Call) -> Call | None:
    """``call`` carried in an envelope (``serve.tunnel``), None where it cannot be: only
    Leyline's own requests with a JSON body or none (a host's plain request carried in
    one is answered by the host, whose errors are not the protocol's)."""
    try:
        body = None if call.body is None else json.loads(call.body)
    except ValueError:
        return None
    if not is_leyline_request(call) or call.method not in ("GET", "POST", "DELETE"):
        return None
    outer = envelope_body(call.method, call.path, body, "m")
    return replace(
        call,
        method="POST",
        path=ENVELOPE_PATH,
        body=encode(outer),
        label=f"{call.label}, enveloped",
    )


class Fuzzer:
    def __init__(self, source: Source, limits: Limits) -> None:
        self.source = source
        self.limits = limits

    def next(self, views: Views) -> Call:
        src = self.source
        kind = src.integer(0, 99)
        auth = "key" if not chance(src, 3) else pick(src, ("none", "wrong"))
        if kind < 15:
            return self._garbage(auth)
        if kind < 45:
            call = self._directives(views)
        elif kind < 59:
            call = self._chat(views)
        elif kind < 69:
            call = self._completion(views)
        elif kind < 76:
            call = self._create()
        elif kind < 82:
            call = self._get_or_delete()
        elif kind < 88:
            call = self._skills()
        elif kind < 95:
            call = self._tokens()
        else:
            method, path = pick(src, ROUTES[2:5])
            if chance(src, 30):
                method = pick(src, ("POST", "PUT", "DELETE", "PATCH"))
            call = Call(method, path + pick(src, ("", "?x=1", "?tokens=maybe")), path)
        if chance(src, 8):  # the same request through the tunnel: the same checks hold
            call = enveloped(call) or call
        return replace(call, auth=auth)

    # -- near-valid --------------------------------------------------------------------

    def _body(self, body: Any, label: str) -> tuple[bytes, str]:
        if chance(self.source, 20):
            rounds = self.source.integer(1, 2)  # on a copy: bodies share module constants
            return encode(mutate(self.source, copy.deepcopy(body), rounds)), f"{label}, mutated"
        return encode(body), label

    def _session(self, *, none_ok: bool) -> str | None:
        options: tuple[str | None, ...] = (*BASE_SESSIONS, *POOL)
        if none_ok:
            options += (None,)
        return pick(self.source, options)

    def _directives(self, views: Views) -> Call:
        src = self.source
        if chance(src, 5):
            route = "/leyline/v1/sessions/{id}/directives"
            odd = pick(src, ODD_PATH_IDS)
            return Call("POST", f"/leyline/v1/sessions/{odd}/directives", route, b"{}")
        session = self._session(none_ok=False)
        assert session is not None
        limits = self.limits
        view = views.get(session)
        body = shapes.apply_body(src, view, limits.max_directives, limits.max_replacement_tokens)
        raw, label = self._body(body, "directives")
        path = session_path(session) + "/directives"
        return Call("POST", path, "/leyline/v1/sessions/{id}/directives", raw, session, label=label)

    def _chat(self, views: Views) -> Call:
        src = self.source
        session = self._session(none_ok=True)
        view = views.get(session) if session else None
        limits = (self.limits.max_directives, self.limits.max_replacement_tokens)
        body: dict[str, Any] = {"model": "m", "messages": shapes.messages(src, view)}
        body |= shapes.sampling(src)
        if chance(src, 15):
            body["tools"] = shapes.TOOLS
            body["tool_choice"] = pick(src, ("auto", "none", "required", "bogus"))
        if session is not None or chance(src, 20):
            body["leyline"] = shapes.leyline(src, session, view, limits)
        raw, label = self._body(body, "chat")
        return Call(
            "POST", "/v1/chat/completions", "/v1/chat/completions", raw, session, label=label
        )

    def _completion(self, views: Views) -> Call:
        src = self.source
        session = self._session(none_ok=True)
        view = views.get(session) if session else None
        tokens = list(view["tokens"]) if view and view.get("tokens") else []
        prompt: Any = pick(
            src,
            (
                "The sky is",
                [*tokens, src.integer(0, 49151)],  # an extension of the session
                [*tokens[: max(len(tokens) - 3, 1)], 7],  # diverges near the end
                [1, 2, 10**9],
                [],
                "",
                [[1]],
                *self.limits.edge_prompts(),
            ),
        )
        body: dict[str, Any] = {"prompt": prompt, **shapes.sampling(src)}
        if chance(src, 10):
            body["echo"] = pick(src, (True, "yes"))
        limits = (self.limits.max_directives, self.limits.max_replacement_tokens)
        if session is not None:
            body["leyline"] = shapes.leyline(src, session, view, limits)
        raw, label = self._body(body, "completion")
        return Call("POST", "/v1/completions", "/v1/completions", raw, session, label=label)

    def _create(self) -> Call:
        src = self.source
        session = self._session(none_ok=True)
        body: dict[str, Any] = {} if session is None else {"session": session}
        source_kind = src.integer(0, 6)
        if source_kind == 0:
            body["messages"] = shapes.CONVERSATION
        elif source_kind == 1:
            body["text"] = pick(src, ("one two three", "", "数据 😀"))
        elif source_kind == 2:
            body["tokens"] = pick(src, ([1, 2, 3], [], [10**9], [-1], [7] * 8193))
        elif source_kind == 3:
            body |= {"text": "a", "tokens": [1]}  # two sources at once
        elif source_kind == 4:
            body["session"] = pick(src, ("", "x" * 129, 5, None))
        raw, label = self._body(body, "create")
        return Call(
            "POST", "/leyline/v1/sessions", "/leyline/v1/sessions", raw, session, label=label
        )

    def _get_or_delete(self) -> Call:
        src = self.source
        method = pick(src, ("GET", "GET", "DELETE", "PUT"))
        route = "/leyline/v1/sessions/{id}"
        if chance(src, 20):
            return Call(method, f"/leyline/v1/sessions/{pick(src, ODD_PATH_IDS)}", route)
        session = pick(src, NEW_SESSIONS if method == "DELETE" and chance(src, 80) else POOL)
        query = pick(src, ("", "?tokens=true", "?tokens=false", "?tokens=maybe", "?tokens="))
        return Call(method, session_path(session) + query, route, None, session, label=method)

    def _skills(self) -> Call:
        """The skills resource: register (near-valid bodies), list, get, delete."""
        src = self.source
        kind = src.integer(0, 9)
        if kind <= 4:
            raw, label = self._body(shapes.skill_create(src), "skill create")
            route = "/leyline/v1/skills"
            return Call("POST", route, route, raw, label=label)
        if kind == 5:
            query = pick(src, ("", "?tokens=true", "?x=1"))
            return Call("GET", "/leyline/v1/skills" + query, "/leyline/v1/skills", label="list")
        method = pick(src, ("GET", "GET", "DELETE", "PUT"))
        skill = pick(src, (*shapes.SKILLS, "nope", *ODD_PATH_IDS))
        # The kept skill is deleted rarely: composes need it registered to be accepted.
        if method == "DELETE" and skill == shapes.SKILLS[0] and not chance(src, 20):
            skill = shapes.SKILLS[1]
        query = pick(src, ("", "?tokens=true", "?tokens=maybe")) if method == "GET" else ""
        route = "/leyline/v1/skills/{skill}"
        return Call(method, skill_path(skill) + query, route, label=f"skill {method}")

    def _tokens(self) -> Call:
        src = self.source
        if chance(src, 40):
            tokens = pick(src, ([1, 2, 3], [], [49151], [49152], [-1], [2**70], ["a"], [1.0]))
            raw, label = self._body({"tokens": tokens}, "detokenize")
            return Call(
                "POST", "/leyline/v1/detokenize", "/leyline/v1/detokenize", raw, label=label
            )
        body: dict[str, Any] = pick(
            src,
            (
                {"text": pick(src, ("hello world", "", "数据 😀"))},
                {"messages": shapes.CONVERSATION, "tools": shapes.TOOLS},
                {"messages": shapes.CONVERSATION, "add_generation_prompt": True},
                {"messages": [{"role": "user"}]},
                {"text": "a", "messages": []},
                {},
            ),
        )
        raw, label = self._body(dict(body), "tokenize")
        return Call("POST", "/leyline/v1/tokenize", "/leyline/v1/tokenize", raw, label=label)

    # -- garbage -----------------------------------------------------------------------

    def _garbage(self, auth: str) -> Call:
        src = self.source
        raw, label = garbage(src, self.limits.max_body_bytes)
        method, route = pick(src, (*ROUTES, ("POST", "/v2/nothing")))
        if method == "GET" and chance(src, 70):
            method = "POST"  # a body where none is expected, or a wrong method
        session = pick(src, POOL)
        path = route.replace("{id}", quote(session, safe="")).replace("{skill}", "fz-skill-2")
        named = session if "{id}" in route else None
        return Call(method, path, route, raw, named, auth, f"garbage: {label}")
