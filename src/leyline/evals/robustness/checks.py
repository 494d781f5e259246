"""The invariants every fuzzed request must keep, checked after each one.

* no 5xx (a 501 ``unsupported_verb`` is the protocol's answer for a verb it does not run);
* every 4xx/5xx body is exactly the protocol's error body, its code's HTTP status (a 3xx
  is the framework's trailing-slash redirect: it must carry a Location);
* a rejected request leaves the session it names as it was (tokens, revision, spans, marks)
  and creates none (an id that did not exist still answers 404); a rejected request to the
  skills resource leaves the tenant's skills as they were;
* the keep-alive connection survives (same socket), and a stream ends with ``[DONE]``.

On a server that hosts Leyline beside routes of its own (SGLang: its unknown-path 404 is
not the protocol's body, ``owns_every_route``), the body and 5xx rules apply to Leyline's
requests (under ``/leyline/v1``, or carrying a ``leyline`` object); the host's own answers
are counted (``host_answers``), and the state and connection rules still hold for them.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from leyline.protocol.errors import HTTP_STATUS, ErrorCode

from .fuzz import (
    BASE_SESSIONS,
    NEW_SESSIONS,
    POOL,
    SKILL_ROUTES,
    Call,
    Fuzzer,
    is_leyline_request,
    session_path,
    skill_path,
)
from .shapes import CONVERSATION, SKILLS, View
from .wire import Outcome, Wire

MAX_TOKENS = 400
"""A base session longer than this is recreated (keeps each request's model work small)."""
SWEEP_EVERY = 100
"""Every this many requests, every pool session is compared with what the checks expect."""


@dataclass(frozen=True, slots=True)
class Violation:
    kind: str
    """``5xx``, ``error body``, ``state change``, ``created``, ``connection``, ``stream``."""
    request: str
    status: int
    detail: str
    where: str = ""
    """The route and the generator's label: examples are kept one per (kind, status, where)."""


@dataclass(slots=True)
class Tally:
    requests: int = 0
    setup_requests: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    codes: Counter[str] = field(default_factory=Counter)
    by_route: dict[str, Counter[int]] = field(default_factory=dict)
    labels: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    host_answers: int = 0
    """Failures the host server answered itself (not Leyline's requests): not checked."""

    def count(self, kind: str) -> int:
        return sum(v.kind == kind for v in self.violations)


class Checker:
    """Sends fuzzed calls over one connection and checks each; ``views`` is the expected
    state of every pool session (None: absent)."""

    def __init__(self, wire: Wire, *, every_route: bool = True) -> None:
        self.wire = wire
        self.every_route = every_route
        """False: the server hosts Leyline beside its own routes (module docstring)."""
        self.tally = Tally()
        self.views: dict[str, View | None] = {}
        self._connection: int | None = None
        self._previous: Call | None = None
        self._unnamed: list[str] = []  # sessions created with a server-chosen id
        self.skills: Skills | None = None  # the tenant's skills; None: the server keeps none

    # -- state -------------------------------------------------------------------------

    def read(self, session: str) -> View | None:
        self.tally.setup_requests += 1
        got = self.wire.send("GET", session_path(session) + "?tokens=true")
        if got.status == 404:
            return None
        if got.status != 200:
            raise RuntimeError(f"GET {session!r} answered {got.status}: {got.body[:300]!r}")
        return dict(json.loads(got.body))

    def read_skills(self) -> Skills | None:
        self.tally.setup_requests += 1
        got = self.wire.send("GET", "/leyline/v1/skills")
        if got.status == 501:
            return None  # no compose on this server: the resource is refused whole
        if got.status != 200:
            raise RuntimeError(f"GET skills answered {got.status}: {got.body[:300]!r}")
        listed = json.loads(got.body)["skills"]
        return {s["skill"]: (s["content_hash"], s["num_tokens"]) for s in listed}

    def prepare(self) -> None:
        """Before each request: base sessions exist and stay short; new ones go now and then;
        the kept skill is registered (composes need one to be accepted)."""
        if self.skills is None and self.tally.requests == 0:
            self.skills = self.read_skills()
        if self.skills is not None and SKILLS[0] not in self.skills:
            body = json.dumps({"skill": SKILLS[0], "text": "Rule 1: answer in one word."})
            self._setup("POST", "/leyline/v1/skills", body.encode(), expect=201)
            self.skills = self.read_skills()
        for session in POOL:
            if session not in self.views:
                self.views[session] = self.read(session)
        for session in BASE_SESSIONS:
            view = self.views[session]
            if view is None or view["num_tokens"] > MAX_TOKENS:
                self._setup("DELETE", session_path(session))
                created = json.dumps({"session": session, "messages": CONVERSATION}).encode()
                self._setup("POST", "/leyline/v1/sessions", created, expect=201)
                self.views[session] = self.read(session)
        if self.tally.requests % 25 == 0:
            for session in NEW_SESSIONS:
                if self.views[session] is not None:
                    self._setup("DELETE", session_path(session))
                    self.views[session] = None
        if self.tally.requests % SWEEP_EVERY == 0:
            self.sweep()

    def sweep(self) -> None:
        for session in POOL:
            now = self.read(session)
            if not same_state(self.views[session], now, time.time()):
                self._violate("state change", self._previous, 0, f"{session!r} drifted after it")
                self.views[session] = now

    def cleanup(self) -> None:
        """Delete every session and skill the fuzz made (the pools and server-named ones)."""
        for session in (*POOL, *self._unnamed):
            self.wire.send("DELETE", session_path(session))
        for skill in self.skills or {}:
            self.wire.send("DELETE", skill_path(skill))

    def _setup(
        self, method: str, path: str, body: bytes | None = None, expect: int | None = None
    ) -> None:
        self.tally.setup_requests += 1
        got = self.wire.send(method, path, body)
        if got.status >= 500 or got.status == 0 or expect not in (None, got.status):
            raise RuntimeError(f"setup {method} {path} failed: {got.status} {got.body[:300]!r}")

    # -- one request -------------------------------------------------------------------

    def step(self, fuzzer: Fuzzer) -> Outcome:
        """Prepare the pool, draw one request against it, send and check it."""
        self.prepare()
        return self.run(fuzzer.next(self.views))

    def run(self, call: Call) -> Outcome:
        before = self.views.get(call.session) if call.session else None
        got = self.wire.send(call.method, call.path, call.body, call.auth)
        self._count(call, got)
        self._check_connection(call, got)
        code = self._check_body(call, got) if got.status else "no answer"
        if got.status == 201 and call.session is None:
            self._unnamed.append(str(json.loads(got.body).get("session")))
        if call.session in POOL:
            after = self.read(call.session)
            accepted = 200 <= got.status < 300
            if got.status and not accepted and not same_state(before, after, time.time()):
                kind = "created" if before is None else "state change"
                detail = f"{call.session!r}: {_diff(before, after)} ({code})"
                self._violate(kind, call, got.status, detail)
            self.views[call.session] = after
        if call.route in SKILL_ROUTES and self.skills is not None:
            self._check_skills(call, got)
        self._previous = call
        return got

    def _check_skills(self, call: Call, got: Outcome) -> None:
        before, after = self.skills, self.read_skills()
        if got.status and not 200 <= got.status < 300 and after != before:
            kind = "created" if set(after or ()) - set(before or ()) else "state change"
            detail = f"skills {sorted(before or ())} -> {sorted(after or ())}"
            self._violate(kind, call, got.status, detail)
        self.skills = after

    def _count(self, call: Call, got: Outcome) -> None:
        tally = self.tally
        tally.requests += 1
        tally.statuses[got.status] += 1
        tally.by_route.setdefault(call.route, Counter())[got.status] += 1
        tally.labels[call.label or call.method] += 1

    def _check_connection(self, call: Call, got: Outcome) -> None:
        if got.status == 0:
            detail = f"no answer ({got.error}); the request before: {_show(self._previous)}"
            self._violate("connection", call, 0, detail)
        elif self._connection is not None and got.connection != self._connection:
            detail = f"a new connection was needed after: {_show(self._previous)}"
            self._violate("connection", call, got.status, detail)
        if got.closed:
            self._violate("connection", call, got.status, "answered with Connection: close")
        self._connection = got.connection

    def _check_body(self, call: Call, got: Outcome) -> str:
        if 200 <= got.status < 300:
            problem = _success_problem(got)
            if problem:
                self._violate("stream", call, got.status, problem)
            return "ok"
        if 300 <= got.status < 400:
            # Starlette's slash redirect (``/sessions/%2F`` -> ``/sessions/``): not a
            # failure, but it must say where to go. Counted in the histogram.
            if not got.location:
                self._violate("error body", call, got.status, "redirect, no Location")
            return "redirect"
        if not self.every_route and not is_leyline_request(call):
            self.tally.host_answers += 1
            return "host"
        code, problem = _error_problem(got)
        self.tally.codes[code] += 1
        if got.status >= 500 and code != ErrorCode.unsupported_verb:
            self._violate("5xx", call, got.status, got.body[:300].decode(errors="replace"))
        if problem:
            self._violate("error body", call, got.status, problem)
        return code

    def _violate(self, kind: str, call: Call | None, status: int, detail: str) -> None:
        where = f"{call.route} [{call.label}]" if call else ""
        self.tally.violations.append(Violation(kind, _show(call), status, detail, where))


def owns_every_route(base_url: str) -> bool:
    """Whether the server answers an unknown path with the protocol's 404 (``leyline
    serve``), rather than a host's own (SGLang with the plugin)."""
    import httpx

    reply = httpx.get(f"{base_url}/leyline-robustness-no-such-path", timeout=30)
    answer = Outcome(404, reply.content, reply.headers.get("content-type", ""), 0.0, None)
    return reply.status_code == 404 and not _error_problem(answer)[1]


def _error_problem(got: Outcome) -> tuple[str, str]:
    """(code, what is wrong with the error body, or "")."""
    try:
        body: Any = json.loads(got.body)
        error = body["error"]
        code = str(error["code"])
    except (ValueError, KeyError, TypeError):
        return "?", f"not the protocol's error body: {got.body[:200]!r}"
    if set(body) != {"error"} or set(error) != {"type", "code", "message", "field"}:
        return code, f"extra or missing keys: {sorted(body)} / {sorted(error)}"
    if error["type"] != "leyline_error" or code not in ErrorCode.__members__:
        return code, f"type {error['type']!r}, code {code!r}"
    if HTTP_STATUS[ErrorCode(code)] != got.status:
        return code, f"code {code} is HTTP {HTTP_STATUS[ErrorCode(code)]}, got {got.status}"
    if not isinstance(error["message"], str) or not error["message"]:
        return code, "empty message"
    if error["field"] is not None and not isinstance(error["field"], str):
        return code, f"field {error['field']!r}"
    return code, ""


def _success_problem(got: Outcome) -> str:
    if got.status == 204:
        return "" if not got.body else "a 204 with a body"
    if got.content_type.startswith("text/event-stream"):
        return "" if got.body.rstrip().endswith(b"data: [DONE]") else "stream without [DONE]"
    try:
        json.loads(got.body)
    except ValueError:
        return f"a {got.status} whose body is not JSON"
    return ""


def same_state(before: View | None, after: View | None, now: float) -> bool:
    """Whether a session is as it was, a pin whose ``ttl_s`` ran out by ``now`` aside: the
    server drops those itself (protocol 3.5), whatever request came in meanwhile."""
    return _unlapsed(before, now) == _unlapsed(after, now)


def _unlapsed(view: View | None, now: float) -> View | None:
    if view is None or not view.get("marks"):
        return view
    marks = [m for m in view["marks"] if m.get("expires_at") is None or m["expires_at"] > now]
    return {**view, "marks": marks}


def _diff(before: View | None, after: View | None) -> str:
    if before is None or after is None:
        return f"{_presence(before)} -> {_presence(after)}"
    keys = [
        k
        for k in ("revision", "num_tokens", "tokens", "spans", "marks")
        if before.get(k) != after.get(k)
    ]
    return f"changed {keys}: revision {before['revision']} -> {after['revision']}, " + (
        f"{before['num_tokens']} -> {after['num_tokens']} tokens"
    )


Skills = dict[str, tuple[str, int]]
"""A tenant's skills as ``GET /leyline/v1/skills`` lists them: id -> (content hash, tokens)."""

KINDS = ("5xx", "error body", "state change", "created", "connection", "stream")


def summarize(tally: Tally, seconds: float, keep: int = 40) -> dict[str, Any]:
    """The fuzz figures for report.json: histograms, violation counts, distinct examples."""
    distinct: dict[tuple[str, int, str], Violation] = {}
    times: Counter[tuple[str, int, str]] = Counter()
    for v in tally.violations:
        distinct.setdefault((v.kind, v.status, v.where), v)
        times[v.kind, v.status, v.where] += 1
    return {
        "requests": tally.requests,
        "setup_requests": tally.setup_requests,
        "seconds": seconds,
        "requests_per_s": tally.requests / seconds if seconds else None,
        "statuses": {str(k): n for k, n in sorted(tally.statuses.items())},
        "codes": dict(tally.codes.most_common()),
        "by_route": {
            r: {str(k): n for k, n in sorted(c.items())} for r, c in tally.by_route.items()
        },
        "labels": dict(tally.labels.most_common()),
        "host_answers": tally.host_answers,
        "violations": {kind: tally.count(kind) for kind in KINDS},
        "examples": [
            {
                "kind": v.kind,
                "status": v.status,
                "where": v.where,
                "detail": v.detail,
                "request": v.request,
                "times": times[key],
            }
            for key, v in list(distinct.items())[:keep]
        ],
    }


def _show(call: Call | None) -> str:
    return call.reproducer() if call else "(none)"


def _presence(view: View | None) -> str:
    return "absent" if view is None else "present"
