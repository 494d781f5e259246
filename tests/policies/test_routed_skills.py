"""Skills behind a router, on a TOY fleet (no model, no torch): a routed ``SkillLibrary``
registers a skill on the worker of the session that will compose it, and a wrapper whose
session's worker lacks a skill (``unknown_skill``) registers it there again, sends that
call's skill as text and composes it from the next call.

Two ``ComposeServer`` workers (SCRIPTED Leyline servers on the toy rendering) behind a toy
router that unpacks envelopes, as a worker's tunnel does, and keeps each routing key on one
worker (a new key on the worker with fewer keys, as sglang-router's ``min_group``). The
same on real ``leyline serve`` workers behind a stand-in of sglang-router:
``test_routed_client.py``.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import httpx
import openai

from leyline.policies import AsyncLeylineOpenAI, AsyncSkillLibrary, LeylineOpenAI, SkillLibrary
from leyline.policies.middleware_core import CallRecord
from leyline.protocol.client import AsyncLeylineClient, LeylineClient
from leyline.protocol.routing import ROUTING_KEY

from .compose_server import BASE, OPENAI_HTTPX, ComposeServer
from .transcripts import Msg, system, user

RULES = "Rules of this repository:\n" + "- run the tests before every commit\n" * 12


@dataclass(frozen=True)
class Forwarded:
    worker: int
    key: str | None
    method: str
    path: str
    body: Any


class ToyFleet:
    """``n`` toy workers behind a toy router: every request must be an envelope."""

    def __init__(self, n: int = 2) -> None:
        self.workers = [ComposeServer() for _ in range(n)]
        self.keys: dict[str, int] = {}
        self.forwarded: list[Forwarded] = []
        self.refuse_skills = False
        """Workers answer ``POST /leyline/v1/skills`` with 413 ``limit_exceeded``."""

    def pick(self, key: str | None) -> int:
        if key is None:
            return len(self.forwarded) % len(self.workers)
        if key not in self.keys:
            held = [list(self.keys.values()).count(i) for i in range(len(self.workers))]
            self.keys[key] = held.index(min(held))
        return self.keys[key]

    def handler(self, http: ModuleType) -> Any:
        def handle(request: Any) -> Any:
            assert (request.method, request.url.path) == ("POST", "/v1/completions")
            route = json.loads(request.content)["leyline"]["route"]
            key = request.headers.get(ROUTING_KEY)
            worker = self.pick(key)
            method, path, body = route["method"], route["path"], route["body"]
            self.forwarded.append(Forwarded(worker, key, method, path, body))
            if self.refuse_skills and (method, path) == ("POST", "/leyline/v1/skills"):
                error = {"type": "leyline_error", "code": "limit_exceeded", "message": "full"}
                return http.Response(413, json={"error": error})
            content = json.dumps(body).encode() if body is not None else b""
            status, answer = self.workers[worker].answer(method, path, content)
            if isinstance(answer, bytes):
                headers = {"content-type": "text/event-stream"}
                return http.Response(status, content=answer, headers=headers)
            return http.Response(status, json=answer) if answer is not None else http.Response(204)

        return http.MockTransport(handle)

    def openai(self) -> openai.OpenAI:
        http = OPENAI_HTTPX.Client(transport=self.handler(OPENAI_HTTPX))
        return openai.OpenAI(base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http)

    def async_openai(self) -> openai.AsyncOpenAI:
        http = OPENAI_HTTPX.AsyncClient(transport=self.handler(OPENAI_HTTPX))
        return openai.AsyncOpenAI(
            base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http
        )

    def leyline(self) -> LeylineClient:
        http = httpx.Client(transport=self.handler(httpx))
        return LeylineClient(BASE, http_client=http, routed=True)

    def async_leyline(self) -> AsyncLeylineClient:
        http = httpx.AsyncClient(transport=self.handler(httpx))
        return AsyncLeylineClient(BASE, http_client=http, routed=True)

    def registrations(self, worker: int) -> list[dict[str, Any]]:
        return self.workers[worker].registrations

    def of(self, key: str, path: str) -> list[Forwarded]:
        return [f for f in self.forwarded if f.key == key and f.path == path]


def ask(client: LeylineOpenAI, history: list[Any]) -> CallRecord:
    completion = client.chat.completions.create(model="toy", messages=history)
    history.append(completion.choices[0].message.model_dump(exclude_none=True))
    return client.records[-1]


def opening() -> list[Msg]:
    return [system(), user("Fix the failing test.")]


def test_a_routed_library_registers_on_the_worker_of_the_session_given() -> None:
    fleet = ToyFleet()
    library = SkillLibrary(fleet.leyline())
    first = library.register("rules", RULES, role="user", routing_key="agent-a")
    assert fleet.keys == {"agent-a": 0} and list(fleet.workers[0].skills) == [first.skill]
    assert [f.path for f in fleet.of("agent-a", "/leyline/v1/tokenize")] == ["/leyline/v1/tokenize"]
    # Remembered for that key: nothing sent.
    assert library.register("rules", RULES, role="user", routing_key="agent-a") is first
    assert len(fleet.forwarded) == 2
    # Another session (another worker): the same block sent again, no rendering.
    again = library.register("rules", RULES, role="user", routing_key="agent-b")
    assert again is first and fleet.keys["agent-b"] == 1
    assert [(f.method, f.path) for f in fleet.forwarded[2:]] == [("POST", "/leyline/v1/skills")]
    held = [fleet.workers[w].skills[first.skill] for w in (0, 1)]
    assert held[0] == held[1] == first.tokens  # the same content, the same id
    # The client's own key when none is given.
    keyed = SkillLibrary(fleet.leyline().with_routing_key("agent-a"))
    keyed.register("rules", RULES, role="user")
    assert {f.key for f in fleet.forwarded[3:]} == {"agent-a"}


def test_a_skill_the_sessions_worker_lacks_is_registered_again_and_composed_next() -> None:
    fleet = ToyFleet()
    library = SkillLibrary(fleet.leyline())
    entry = library.register("rules", RULES, role="user", routing_key="agent-a")
    a = LeylineOpenAI(fleet.openai(), skills=library, session="agent-a", routed=True)
    b = LeylineOpenAI(fleet.openai(), skills=library, session="agent-b", routed=True)
    ha, hb = opening(), opening()
    ask(a, ha), ask(b, hb)
    assert fleet.keys == {"agent-a": 0, "agent-b": 1}
    ha += [library.message("rules"), user("Go.")]
    assert ask(a, ha).composed == (entry.skill,)  # registered on agent-a's worker
    hb += [library.message("rules"), user("Go.")]
    sent = len(hb)
    record = ask(b, hb)  # agent-b's worker has no such skill
    assert (record.resync, record.reregistered, record.composed) == (
        "unknown_skill",
        (entry.skill,),
        (),
    )
    turns = [f.body for f in fleet.of("agent-b", "/v1/chat/completions")]
    assert "compose" in str(turns[-2]["leyline"]["directives"])
    resent = turns[-1]
    assert not resent["leyline"].get("directives") and len(resent["messages"]) == sent
    assert resent["messages"][3] == {"role": "user", "content": RULES}  # its text, this call
    (registered,) = fleet.registrations(1)
    assert registered["skill"] == entry.skill and registered["tokens"] == list(entry.tokens)
    assert fleet.of("agent-b", "/leyline/v1/skills")  # with agent-b's routing key
    assert "rules" in library and fleet.workers[1].skills[entry.skill] == entry.tokens
    hb += [library.message("rules"), user("Once more.")]
    later = ask(b, hb)
    assert (later.composed, later.resync, later.path) == ((entry.skill,), None, "splice")
    # The library knows where it is now: registering for agent-b sends nothing.
    count = len(fleet.forwarded)
    library.register("rules", RULES, role="user", routing_key="agent-b")
    assert len(fleet.forwarded) == count
    for worker in fleet.workers:
        assert worker.mismatches == [] and worker.leaks == []


def test_a_worker_that_lost_the_skill_gets_it_again() -> None:
    fleet = ToyFleet()
    library = SkillLibrary(fleet.leyline())
    entry = library.register("rules", RULES, role="user", routing_key="agent-a")
    a = LeylineOpenAI(fleet.openai(), skills=library, session="agent-a", routed=True)
    history = opening()
    ask(a, history)
    del fleet.workers[0].skills[entry.skill]  # evicted, or the worker restarted
    history += [library.message("rules"), user("Go.")]
    assert ask(a, history).reregistered == (entry.skill,)
    history += [library.message("rules"), user("Again.")]
    assert ask(a, history).composed == (entry.skill,)
    assert len(fleet.registrations(0)) == 2 and fleet.registrations(1) == []


def test_a_refused_registration_forgets_the_skill_as_direct_mode_does() -> None:
    fleet = ToyFleet()
    library = SkillLibrary(fleet.leyline())
    entry = library.register("rules", RULES, role="user", routing_key="agent-a")
    b = LeylineOpenAI(fleet.openai(), skills=library, session="agent-b", routed=True)
    history = opening()
    ask(b, history)
    fleet.refuse_skills = True
    history += [library.message("rules"), user("Go.")]
    record = ask(b, history)
    assert (record.resync, record.reregistered) == ("unknown_skill", ())
    assert "rules" not in library and entry.skill not in fleet.workers[1].skills
    history.append(user("Again."))
    assert ask(b, history).resync is None  # the episode goes on


def test_direct_mode_still_forgets_a_skill_the_server_lacks() -> None:
    server = ComposeServer()
    library = SkillLibrary(server.leyline())
    entry = library.register("rules", RULES, role="user")
    client = LeylineOpenAI(server.openai(), skills=library)
    history = opening()
    ask(client, history)
    del server.skills[entry.skill]
    history += [library.message("rules"), user("Go.")]
    record = ask(client, history)
    assert (record.resync, record.reregistered) == ("unknown_skill", ())
    assert "rules" not in library and len(server.registrations) == 1


def test_the_async_wrapper_registers_again_too() -> None:
    fleet = ToyFleet()

    async def episode() -> tuple[AsyncLeylineOpenAI, str]:
        library = AsyncSkillLibrary(fleet.async_leyline())
        entry = await library.register("rules", RULES, role="user", routing_key="agent-a")
        b = AsyncLeylineOpenAI(fleet.async_openai(), skills=library, session="agent-b", routed=True)
        history: list[Any] = opening()
        for extra in ([], [library.message("rules"), user("Go.")], [user("Next.")]):
            history += extra
            done = await b.chat.completions.create(model="toy", messages=history)
            history.append(done.choices[0].message.model_dump(exclude_none=True))
        history += [library.message("rules"), user("Again.")]
        await b.chat.completions.create(model="toy", messages=history)
        return b, entry.skill

    client, skill = asyncio.run(episode())
    records = client.records
    assert (records[1].resync, records[1].reregistered) == ("unknown_skill", (skill,))
    assert records[-1].composed == (skill,) and records[-1].path == "splice"
    assert fleet.keys["agent-b"] == 1 and skill in fleet.workers[1].skills
    assert all(w.leaks == [] and w.mismatches == [] for w in fleet.workers)
