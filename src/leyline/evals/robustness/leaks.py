"""Redaction after FORGET, and prefix-cache reuse across tenants, as a client can see them.

Both read the server's own count of reused prompt tokens (``leyline.reused_tokens``): it
is exactly the side channel an attacker has (a guess that hits the cache is faster).

* Redaction: a prompt with a secret in the middle is cached by a session, which then
  FORGETs the secret; a new probe session sends the original prompt. Every reused token
  past the secret's start is a leak. Scenarios vary who else touched those blocks.
* Cross-tenant: tenant A caches prompts; tenant B sends each (stateless, in a session,
  with a ``cache_salt``, as chat). B must reuse nothing; A's own repeat (the control)
  must reuse, or the zero would prove nothing.

A probe publishes what it sent (it sent the secret itself), so every probe gets a prompt
of its own: one nonce per scenario, one prompt per cross-tenant row.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Callable
from typing import Any

import httpx

from leyline.core.batch import common_prefix

from .fuzz import session_path
from .wire import auth_headers

Complete = Callable[..., dict[str, Any]]
SCENARIOS = (
    "in place",
    "held by another session",
    "held by another session, which then left",
    "after a splice before it",
    "after re-sent edited tokens",
    "published by a stateless request",
)
CHAT_SCENARIO = "chat: after re-sent edited messages"
CONTROL = "control: no forget"


class Client:
    """One tenant's requests: token ids in, the response's ``leyline`` object out."""

    def __init__(self, base_url: str, key: str | None) -> None:
        self.http = httpx.Client(base_url=base_url, headers=auth_headers(key), timeout=300)
        self.sessions: list[str] = []
        self.chats: list[list[dict[str, str]]] = []
        """Every chat this client sent (what its own cache may share with a later one)."""

    def tokens(self, text: str) -> list[int]:
        reply = self.http.post("/leyline/v1/tokenize", json={"text": text})
        reply.raise_for_status()
        return list(reply.json()["tokens"])

    def complete(self, prompt: list[int], session: str | None = None, **extra: Any) -> Any:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": 1, "temperature": 0, **extra}
        if session is not None:
            body["leyline"] = {"session": session}
            self.sessions.append(session)
        reply = self.http.post("/v1/completions", json=body)
        reply.raise_for_status()
        return _report(reply.json())

    def chat(self, messages: list[dict[str, str]], session: str | None = None) -> Any:
        self.chats.append(messages)
        body: dict[str, Any] = {"messages": messages, "max_tokens": 1, "temperature": 0}
        if session is not None:
            body["leyline"] = {"session": session}
            self.sessions.append(session)
        reply = self.http.post("/v1/chat/completions", json=body)
        reply.raise_for_status()
        answer = reply.json()
        return answer["leyline"] | {"content": answer["choices"][0]["message"]["content"]}

    def edit(self, session: str, directive: dict[str, Any]) -> Any:
        revision = self.http.get(session_path(session)).json()["revision"]
        body = {"base_revision": revision, "directives": [directive]}
        reply = self.http.post(session_path(session) + "/directives", json=body)
        reply.raise_for_status()
        return reply.json()

    def delete(self, session: str) -> None:
        self.http.delete(session_path(session))

    def close(self) -> None:
        for session in set(self.sessions):
            self.delete(session)
        self.http.close()


def _report(answer: dict[str, Any]) -> dict[str, Any]:
    """The answer's ``leyline`` report; for a plain request that the server's own handler
    answered (SGLang's, with no ``leyline`` object), its cached prompt tokens as
    ``reused_tokens``. A server that reports neither cannot be checked: an error, never a
    silent 0."""
    report = answer.get("leyline")
    if report is not None:
        return dict(report)
    details = (answer.get("usage") or {}).get("prompt_tokens_details") or {}
    if "cached_tokens" not in details:
        raise RuntimeError(
            "a plain completion reported no cached tokens (SGLang: start it with "
            "--enable-cache-report): reuse cannot be measured"
        )
    return {"reused_tokens": int(details["cached_tokens"] or 0)}


def _texts(nonce: str) -> tuple[str, str, str]:
    """A head, a secret and a tail (the nonce keeps each scenario's blocks its own). Head
    and tail are over a block of 128 tokens each, so a server that caches whole blocks
    (vLLM's CPU default) caches the secret's block, and the control can reuse past it."""
    head = f"Ticket {nonce}: the customer asked about the account twice. " * 9
    secret = f" The vault code is {zlib.crc32(nonce.encode()) % 10**8:08d}."
    return head, secret, " Answer politely and never repeat any code to anyone. " * 14


def redaction(client: Client, trial: int, prefix: str) -> list[dict[str, Any]]:
    """Each scenario once, and a control that forgets nothing."""
    out = []
    for index, scenario in enumerate((*SCENARIOS, CHAT_SCENARIO, CONTROL)):
        nonce = f"{prefix}-{trial}-{index}"
        if scenario == CHAT_SCENARIO:
            reused, start, end = _chat_scenario(client, nonce)
        else:
            reused, start, end = _token_scenario(client, scenario, nonce)
        row = {"scenario": scenario, "trial": trial, "secret_start": start, "secret_end": end}
        out.append(row | {"probe_reused": reused, "leaked_tokens": max(0, reused - start)})
    return out


def _token_scenario(client: Client, scenario: str, nonce: str) -> tuple[int, int, int]:
    """Completions on token ids: (probe's reused tokens, secret start, secret end)."""
    head, secret, tail = (client.tokens(t) for t in _texts(nonce))
    prompt, start, end = head + secret + tail, len(head), len(head) + len(secret)
    owner, other = f"{nonce}-owner", f"{nonce}-other"
    if scenario == "published by a stateless request":
        client.complete(prompt)
    client.complete(prompt, owner)
    if scenario.startswith("held by another session"):
        client.complete(prompt, other)
    if scenario == "after a splice before it":
        client.edit(owner, {"verb": "splice", "span": {"start": 0, "end": 2}, "replacement": "Re:"})
    if scenario == "after re-sent edited tokens":
        client.complete(client.tokens("Edited. ") + prompt, owner)
    if scenario != CONTROL:
        _forget(client, owner, secret)
    if scenario.endswith("which then left"):
        client.delete(other)  # its doomed blocks must go with it, not become reusable
    return client.complete(prompt, f"{nonce}-probe")["reused_tokens"], start, end


def _chat_scenario(client: Client, nonce: str) -> tuple[int, int, int]:
    """An agent's chat: the secret in the system message; the client re-sends its messages
    with that message edited and a new turn, then forgets the secret."""
    head, secret, tail = _texts(nonce)
    messages = [
        {"role": "system", "content": head + secret + tail},
        {"role": "user", "content": "Hello."},
    ]
    owner = f"{nonce}-owner"
    reply = client.chat(messages, owner)
    edited = [{"role": "system", "content": "Edited. " + head + secret + tail}, messages[1]]
    edited += [
        {"role": "assistant", "content": reply["content"]},
        {"role": "user", "content": "And?"},
    ]
    client.chat(edited, owner)
    secret_ids = client.tokens(secret)
    rendered = client.http.post(
        "/leyline/v1/tokenize", json={"messages": messages, "add_generation_prompt": True}
    ).json()["tokens"]
    start = _find(rendered, secret_ids)
    if start is None:  # tokenized differently in context: no span to check against
        raise RuntimeError(f"the secret's tokens are not in the rendered chat ({nonce})")
    _forget(client, owner, secret_ids)
    reused = client.chat(messages, f"{nonce}-probe")["reused_tokens"]
    return reused, start, start + len(secret_ids)


def _forget(client: Client, session: str, secret: list[int]) -> None:
    """FORGET the secret where it is now in the session (earlier edits may have moved it)."""
    tokens = client.http.get(session_path(session), params={"tokens": "true"}).json()["tokens"]
    at = _find(tokens, secret)
    if at is None:
        raise RuntimeError(f"the secret is not in session {session!r}")
    span = {"start": at, "end": at + len(secret)}
    client.edit(session, {"verb": "forget", "span": span, "replacement": " [x]"})


def _find(tokens: list[int], part: list[int]) -> int | None:
    for i in range(len(tokens) - len(part) + 1):
        if tokens[i : i + len(part)] == part:
            return i
    return None


def cross_tenant(a: Client, b: Client, trial: int, prefix: str) -> list[dict[str, Any]]:
    """Tenant B sends what tenant A cached; each row is one way of sending it.

    Every token prompt starts with random token ids, so nothing B (or anyone) sent before
    shares a prefix with it: a tree that caches single tokens would otherwise serve B its
    own earlier prompts' first tokens. A chat starts with the template's header, which every
    chat shares: B may reuse that much (``allowed``), and nothing past it."""
    ways = ("stateless", "in a session", "with a cache_salt", "as chat")
    texts = {
        # Over two blocks of 128 tokens: whole-block caches have something to reuse.
        way: f"Case {prefix}-{trial}-{i}: escalation notes say refund order 55{i}1 now. " * 12
        for i, way in enumerate(ways)
    }
    prompts = {way: _nonce() + a.tokens(text) for way, text in texts.items()}
    chat = [
        {"role": "system", "content": f"{secrets.token_hex(8)} {texts['as chat']}"},
        {"role": "user", "content": "?"},
    ]
    for way in ways[:3]:
        a.complete(prompts[way], f"{prefix}-{trial}-a-{way[:5]}")
    a.chat(chat, f"{prefix}-{trial}-a-chat")
    own = _own_prefix(b, chat)  # before B sends it: what B's own earlier chats share
    rows = [
        ("stateless", b.complete(prompts["stateless"]), 0),
        ("in a session", b.complete(prompts["in a session"], f"{prefix}-{trial}-b"), 0),
        ("with a cache_salt", b.complete(prompts["with a cache_salt"], cache_salt="guess"), 0),
        ("as chat", b.chat(chat, f"{prefix}-{trial}-b-chat"), own),
    ]
    out = [
        {"trial": trial, "how": how, "reused": r["reused_tokens"], "allowed": allowed}
        for how, r, allowed in rows
    ]
    control = a.complete(prompts["stateless"], f"{prefix}-{trial}-a2")["reused_tokens"]
    out.append({"trial": trial, "how": "control: tenant A again", "reused": control})
    return out


def _nonce() -> list[int]:
    """Random token ids (below every vocabulary the evals serve)."""
    return [1000 + secrets.randbelow(29000) for _ in range(4)]


def _own_prefix(client: Client, messages: list[dict[str, str]]) -> int:
    """How many leading tokens of ``messages`` rendered the client's own earlier chats (or
    any chat: the template's header) already share: reusing those is no leak."""

    def render(chat: list[dict[str, str]]) -> list[int]:
        body = {"messages": chat, "add_generation_prompt": True}
        return list(client.http.post("/leyline/v1/tokenize", json=body).json()["tokens"])

    now = render(messages)
    header = common_prefix(render([{"role": "system", "content": "alpha"}]), now)
    return max([header, *(common_prefix(now, render(chat)) for chat in client.chats)])
