"""The typed ``LeylineClient`` in routed mode through a stand-in of sglang-router 0.3.2
(``router_stand_in``) on two real ``leyline serve`` workers (the random-weight tiny MLA
model, in this process, real HTTP; sessions and skills in token ids): each session's calls
on one worker, a skill on the worker of the session it was registered for, and a worker
killed and started again, which lost both. The envelope's shape: tests/protocol/
test_client_routed.py; the wrappers' routed skills on SmolLM2: test_router_stand_in.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from leyline.protocol import ComposeDirective, ErrorCode, LeylineError, SpliceDirective, TokenSpan
from leyline.protocol.client import LeylineClient

from .router_stand_in import RouterStandIn, router_stand_in

pytest.importorskip("torch")

MODEL = "tiny-mla-v3"
PROMPT = [5, 17, 29, 41, 53, 65, 77, 89, 101, 113, 125, 137]
BLOCK = [7, 19, 31, 43, 55, 67]


@pytest.fixture(scope="module")
def workers() -> Iterator[list[str]]:
    """The roots (``http://127.0.0.1:PORT``) of two real ``leyline serve`` workers."""
    from leyline.evals.demo.server import EmbeddedServer

    with EmbeddedServer(MODEL, max_new_tokens=1) as a, EmbeddedServer(MODEL, max_new_tokens=1) as b:
        yield [a.base_url.removesuffix("/v1"), b.base_url.removesuffix("/v1")]


def routed(router: RouterStandIn) -> LeylineClient:
    return LeylineClient(router.root, routed=True, envelope_model=MODEL)


def compose(skill: str) -> ComposeDirective:
    return ComposeDirective(skill=skill, at="end", seam_tokens=1)


def test_each_sessions_calls_go_to_one_worker(workers: list[str]) -> None:
    with router_stand_in(workers) as router, routed(router) as client:
        assert client.capabilities().require_session  # any worker answers
        one = client.create_session(tokens=PROMPT)  # the client names it: the key exists
        two = client.create_session(tokens=PROMPT[:6])
        assert one.session.startswith("leyline-") and one.num_tokens == len(PROMPT)
        assert router.keys[one.session] != router.keys[two.session]
        held = client.get_session(one.session, include_tokens=True)
        assert held.tokens == PROMPT and held.revision == one.revision
        splice = SpliceDirective(span=TokenSpan(start=2, end=5), replacement=[3, 4])
        applied = client.apply(one.session, one.revision, [splice])
        assert applied.revision == one.revision + 1 and applied.session == one.session
        after = client.get_session(one.session, include_tokens=True)
        assert after.tokens == [*PROMPT[:2], 3, 4, *PROMPT[5:]]
        with pytest.raises(LeylineError) as stale:
            client.apply(one.session, one.revision, [splice])  # its revision is gone
        assert stale.value.code is ErrorCode.revision_conflict
        client.delete_session(two.session)
        with pytest.raises(LeylineError) as gone:
            client.get_session(two.session)
        assert gone.value.code is ErrorCode.unknown_session
    assert router.refused == []  # nothing went to /leyline/v1 unenveloped
    for session in (one.session, two.session):
        assert router.workers_of(session) == {router.keys[session]}
    assert all(f.path == "/v1/completions" for f in router.forwarded)
    assert {f.body["model"] for f in router.forwarded} == {MODEL}


def test_a_skill_lands_on_the_worker_of_the_session_it_is_registered_for(
    workers: list[str],
) -> None:
    with router_stand_in(workers) as router, routed(router) as client:
        made_a, made_b = client.create_session(tokens=PROMPT), client.create_session(tokens=PROMPT)
        a, b, revision = made_a.session, made_b.session, made_a.revision
        assert router.keys[a] != router.keys[b]
        skill = f"block-{a}"
        made = client.with_routing_key(a).create_skill(skill, tokens=BLOCK)
        assert router.workers_of(a) == {router.keys[a]}
        assert client.apply(a, revision, [compose(skill)]).composed[0].skill == skill
        with pytest.raises(LeylineError) as missing:
            client.apply(b, revision, [compose(skill)])  # b's worker never had it
        assert missing.value.code is ErrorCode.unknown_skill
        again = client.with_routing_key(b).create_skill(skill, tokens=BLOCK)
        assert (again.skill, again.content_hash) == (skill, made.content_hash)
        assert client.apply(b, revision, [compose(skill)]).composed[0].skill == skill
    registrations = [
        f for f in router.forwarded if (f.route or {}).get("path", "").endswith("/skills")
    ]
    assert [(f.key, f.worker) for f in registrations] == [(a, router.keys[a]), (b, router.keys[b])]


def test_a_worker_started_again_has_lost_its_sessions_and_skills(workers: list[str]) -> None:
    from leyline.evals.demo.server import EmbeddedServer

    with router_stand_in(workers) as router, routed(router) as client:
        a = client.create_session(tokens=PROMPT).session
        skill = f"block-{a}"
        client.with_routing_key(a).create_skill(skill, tokens=BLOCK)
        dead = router.keys[a]
        router.kill(dead)
        with EmbeddedServer(MODEL, max_new_tokens=1) as fresh:
            router.restart(dead, fresh.base_url.removesuffix("/v1"))
            with pytest.raises(LeylineError) as lost:
                client.get_session(a)  # the key went back to its worker: a fresh one
            assert lost.value.code is ErrorCode.unknown_session
            made = client.create_session(f"{a}~1", tokens=PROMPT)
            renewed, revision = made.session, made.revision
            with pytest.raises(LeylineError) as missing:
                client.apply(renewed, revision, [compose(skill)])
            assert missing.value.code is ErrorCode.unknown_skill
            client.with_routing_key(renewed).create_skill(skill, tokens=BLOCK)
            assert client.apply(renewed, revision, [compose(skill)]).composed[0].skill == skill
    assert router.workers_of(a) == {dead}
