"""Lost updates: clients append to shared sessions, each write addressed to the revision
it read (``base_revision``); some deliberately address an older one (a stale extension).

A write the server accepted must survive: its marker tokens are in the session's final
tokens, no two accepted writes to one session addressed the same revision, and no stale
write was accepted. Writes alternate between an ``erratum`` directive and a completion
that extends the session's tokens (``/v1/completions`` with token ids and a session).
"""

from __future__ import annotations

import itertools
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from .fuzz import session_path
from .wire import auth_headers

STALE_EVERY = 5
"""Every fifth turn of a client is a stale write (addressed to the revision before)."""
RETRIES = 4


@dataclass(frozen=True, slots=True)
class Write:
    session: str
    base: int
    revision: int
    marker: tuple[int, ...]
    stale: bool


Marker = tuple[str, tuple[int, ...]]
"""A write's unique text and its token ids (what an erratum appends for that text)."""


def lost_updates(
    base_url: str, key: str | None, clients: int, turns: int, tick: Callable[[], None], prefix: str
) -> dict[str, Any]:
    headers = auth_headers(key)
    sessions = [f"{prefix}-race-{i}" for i in range(max(1, clients // 2))]
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as http:
        for session in sessions:
            made = http.post("/leyline/v1/sessions", json={"session": session, "text": "Log:"})
            made.raise_for_status()
        markers: dict[tuple[int, int], Marker] = {}
        for c in range(clients):
            for t in range(turns):
                text = f" [c{c:02d}t{t:03d}]"
                reply = http.post("/leyline/v1/tokenize", json={"text": text})
                markers[c, t] = (text, tuple(reply.json()["tokens"]))
    accepted: list[Write] = []
    counts: Counter[str] = Counter()
    lock = threading.Lock()

    def client(c: int) -> None:
        with httpx.Client(base_url=base_url, headers=headers, timeout=300) as http:
            for t in range(turns):
                session = sessions[(c + t) % len(sessions)]
                stale = t % STALE_EVERY == STALE_EVERY - 1
                outcome, write = _turn(http, session, markers[c, t], stale, t % 2 == 0)
                with lock:
                    counts.update(outcome)
                    if write is not None:
                        accepted.append(write)
                tick()

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(client, range(clients)))
    with httpx.Client(base_url=base_url, headers=headers, timeout=300) as http:
        final = {s: _read(http, s)[1] for s in sessions}
        for session in sessions:
            http.delete(session_path(session))
    facts = _verdict(accepted, final)
    return facts | {
        "clients": clients,
        "turns": turns,
        "sessions": len(sessions),
        "answers": dict(sorted(counts.items())),
    }


def _turn(
    http: httpx.Client, session: str, marker: Marker, stale: bool, erratum: bool
) -> tuple[Counter[str], Write | None]:
    """One client turn: read, write at the revision read (or the one before), retry a
    fresh write on 409 with a new read."""
    seen: Counter[str] = Counter()
    text, ids = marker
    for _ in range(RETRIES):
        revision, tokens = _read(http, session)
        base = revision - 1 if stale else revision
        if erratum:
            directive = {"verb": "erratum", "text": text}
            body: dict[str, Any] = {"base_revision": base, "directives": [directive]}
            reply = http.post(session_path(session) + "/directives", json=body)
        else:
            body = {
                "prompt": [*tokens, *ids],
                "max_tokens": 1,
                "temperature": 0,
                "leyline": {"session": session, "base_revision": base},
            }
            reply = http.post("/v1/completions", json=body)
        seen[f"{'stale' if stale else 'fresh'} {reply.status_code}"] += 1
        if reply.status_code == 200:
            answer = reply.json()
            new = answer["revision"] if erratum else answer["leyline"]["revision"]
            return seen, Write(session, base, int(new), ids, stale)
        if reply.status_code != 409 or stale:
            return seen, None
    return seen, None


def _read(http: httpx.Client, session: str) -> tuple[int, list[int]]:
    reply = http.get(session_path(session), params={"tokens": "true"})
    reply.raise_for_status()
    info = reply.json()
    return int(info["revision"]), list(info["tokens"])


def _find(tokens: list[int], marker: tuple[int, ...]) -> int | None:
    n = len(marker)
    for i in range(len(tokens) - n + 1):
        if tuple(tokens[i : i + n]) == marker:
            return i
    return None


def _verdict(accepted: list[Write], final: dict[str, list[int]]) -> dict[str, Any]:
    """Lost updates: accepted writes whose marker is gone, a second accepted write to one
    revision, an accepted stale write; and accepted writes out of revision order."""
    missing = [w for w in accepted if _find(final[w.session], w.marker) is None]
    bases = Counter((w.session, w.base) for w in accepted)
    doubled = sum(n - 1 for n in bases.values() if n > 1)
    stale = sum(w.stale for w in accepted)
    disordered = 0
    for session in final:
        mine = sorted((w for w in accepted if w.session == session), key=lambda w: w.revision)
        places = [_find(final[session], w.marker) for w in mine]
        found = [p for p in places if p is not None]
        disordered += sum(a > b for a, b in itertools.pairwise(found))
    return {
        "accepted_writes": len(accepted),
        "lost_updates": len(missing) + doubled + stale,
        "missing_markers": len(missing),
        "two_writes_one_revision": doubled,
        "stale_writes_accepted": stale,
        "out_of_order": disordered,
        "final_tokens": {s: len(t) for s, t in final.items()},
    }
