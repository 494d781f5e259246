"""COMPOSE over HTTP on `leyline serve`: skills registered once, composed into sessions by
token position or message anchor, alone or beside a splice, and what a rejection leaves.

The numbers: the server's next-token distribution after a compose equals the engine's own
``SessionCache.compose`` of the same skill (whose definition is tested against an
independent computation in ``tests/engine/test_compose.py``), and a compose next
to a splice in one batch equals the two applied one after the other.
"""

from __future__ import annotations

import math
import uuid
from typing import Any

import pytest
import torch

from leyline.protocol.resources import Routes, skill_content_hash

from .conftest import Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

RULES = (
    "Rules for this agent: never delete files outside the workspace; run the tests after "
    "every edit; answer in one short sentence; cite the file and line you changed."
)
LOG = "\n".join(f"step {i}: compiled module_{i}.py in {i * 7} ms, 0 warnings" for i in range(20))


def _new_session(http: Any, text: str) -> dict[str, Any]:
    reply = http.post(Routes.sessions, json={"session": uuid.uuid4().hex, "text": text})
    assert reply.status_code == 201, reply.text
    return dict(reply.json())


def _skill(http: Any, **body: Any) -> dict[str, Any]:
    reply = http.post(Routes.skills, json=body)
    assert reply.status_code == 201, reply.text
    return dict(reply.json())


def _logprobs(http: Any, session: str, tokens: list[int]) -> dict[int, float]:
    body = {
        "prompt": tokens, "max_tokens": 1, "temperature": 0, "logprobs": 5,
        "leyline": {"session": session},
    }  # fmt: skip
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    top = reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    return {int(http.post(Routes.tokenize, json={"text": t}).json()["tokens"][0]): lp
            for t, lp in top.items() if len(http.post(Routes.tokenize, json={"text": t})
                                            .json()["tokens"]) == 1}  # fmt: skip


def test_skills_are_registered_listed_read_and_deleted(server: Server) -> None:
    with server.client() as http:
        info = _skill(http, skill="rules-crud", text=RULES, name="agent rules")
        assert info["num_tokens"] > 10 and info["name"] == "agent rules"
        full = http.get(Routes.skill.format(skill="rules-crud"), params={"tokens": "true"}).json()
        assert full["content_hash"] == skill_content_hash(full["model"], full["tokens"])
        listed = http.get(Routes.skills).json()["skills"]
        assert "rules-crud" in [s["skill"] for s in listed]
        assert http.delete(Routes.skill.format(skill="rules-crud")).status_code == 204
        gone = http.get(Routes.skill.format(skill="rules-crud"))
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_skill"


def test_a_compose_equals_the_engines_and_reports_its_block(server: Server) -> None:
    from leyline.engine.edits.skills import compile_skill
    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model
    from leyline.engine.session import SessionCache

    with server.client() as http:
        skill = _skill(http, skill="rules-eq", text=RULES)
        made = _new_session(http, LOG)
        sid, before = (
            made["session"],
            http.get(
                Routes.session.format(session=made["session"]), params={"tokens": "true"}
            ).json(),
        )
        at = len(before["tokens"]) // 2
        directive = {"verb": "compose", "skill": "rules-eq", "at": at, "seam_tokens": 4}
        reply = http.post(
            Routes.directives.format(session=sid),
            json={"base_revision": before["revision"], "directives": [directive]},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["path"] == "splice" and body["rotated_tokens"] > 0
        n = skill["num_tokens"]
        assert body["composed"] == [{"directive": 0, "skill": "rules-eq", "start": at,
                                     "end": at + n}]  # fmt: skip
        after = http.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
        rules = http.get(Routes.skill.format(skill="rules-eq"), params={"tokens": "true"}).json()
        assert after["tokens"] == before["tokens"][:at] + rules["tokens"] + before["tokens"][at:]
        got = _logprobs(http, sid, after["tokens"] + [28])

    engine = Engine(load_model("smollm2"))
    session = SessionCache(engine)
    session.prefill(before["tokens"])
    session.compose(compile_skill(engine, rules["tokens"], skill_id="x", tenant="t"), at,
                    seam_tokens=4)  # fmt: skip
    session.prefill(after["tokens"] + [28])
    expected = torch.log_softmax(session.next_token_logits().double(), -1)
    assert got and all(math.isclose(lp, float(expected[t]), abs_tol=2e-3) for t, lp in got.items())


def test_a_deviation_compose_says_what_it_recomputed_and_equals_the_engines(
    server: Server,
) -> None:
    """``recompute: deviation`` is advertised and runs: the response counts the recomputed
    tokens as prefilled, and the next-token distribution is the engine's own compose with
    the same ratio (itself tested against an independent computation of the definition in
    ``tests/engine/test_compose_recompute.py``)."""
    from leyline.engine.edits.skills import compile_skill
    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model
    from leyline.engine.session import SessionCache

    with server.client() as http:
        caps = http.get(Routes.capabilities).json()
        assert caps["compose_recompute"] == ["none", "deviation", "attention"]
        skill = _skill(http, skill="rules-dev", text=RULES)
        made = _new_session(http, LOG)
        url = Routes.session.format(session=made["session"])
        before = http.get(url, params={"tokens": "true"}).json()
        at, n = len(before["tokens"]) // 2, skill["num_tokens"]
        directive = {"verb": "compose", "skill": "rules-dev", "at": at, "seam_tokens": 4,
                     "recompute": {"mode": "deviation", "ratio": 0.25}}  # fmt: skip
        reply = http.post(
            Routes.directives.format(session=made["session"]),
            json={"base_revision": before["revision"], "directives": [directive]},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        recomputed = math.ceil(0.25 * (n - 4))
        assert body["path"] == "splice" and body["prefilled_tokens"] == 4 + recomputed
        assert body["reused_tokens"] == len(before["tokens"]) + n - 4 - recomputed
        assert body["composed"] == [{"directive": 0, "skill": "rules-dev", "start": at,
                                     "end": at + n}]  # fmt: skip
        after = http.get(url, params={"tokens": "true"}).json()
        rules = http.get(Routes.skill.format(skill="rules-dev"), params={"tokens": "true"}).json()
        got = _logprobs(http, made["session"], after["tokens"] + [28])

    engine = Engine(load_model("smollm2"))
    compiled = compile_skill(engine, rules["tokens"], skill_id="x", tenant="t")

    def expected(ratio: float | None) -> torch.Tensor:
        session = SessionCache(engine)
        session.prefill(before["tokens"])
        session.compose(compiled, at, seam_tokens=4, recompute_ratio=ratio)
        session.prefill(after["tokens"] + [28])
        return torch.log_softmax(session.next_token_logits().double(), -1)

    want, seam_only = expected(0.25), expected(None)
    assert got and all(math.isclose(lp, float(want[t]), abs_tol=2e-3) for t, lp in got.items())
    # The recompute changed the answer measurably: the seam-only compose is further off.
    assert max(abs(lp - float(seam_only[t])) for t, lp in got.items()) > 1e-2


def test_an_attention_compose_in_a_turn_is_ranked_by_the_turns_question(server: Server) -> None:
    """``recompute: attention`` in a completion turn that composes the block at the end of
    the session and asks a question after it: the question ranks the block, so the reply's
    first-token distribution is the engine's compose given that prompt as the sequence it
    goes on to (tested against an independent computation in
    ``tests/engine/test_compose_attention.py``), and not the seam-only compose that
    an ``apply`` batch (nothing after the block) would give."""
    from leyline.engine.edits.skills import compile_skill
    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model
    from leyline.engine.session import SessionCache
    from leyline.protocol.directives import RecomputeAttention

    with server.client() as http:
        _skill(http, skill="rules-attn", text=RULES)
        rules = http.get(Routes.skill.format(skill="rules-attn"), params={"tokens": "true"})
        block = rules.json()["tokens"]
        made = _new_session(http, LOG)
        url = Routes.session.format(session=made["session"])
        before = http.get(url, params={"tokens": "true"}).json()
        at = len(before["tokens"])
        question = http.post(
            Routes.tokenize, json={"text": " Which rule says what to do after an edit?"}
        ).json()["tokens"]
        prompt = before["tokens"] + block + question
        directive = {"verb": "compose", "skill": "rules-attn", "at": at, "seam_tokens": 4,
                     "recompute": {"mode": "attention", "ratio": 0.25}}  # fmt: skip
        body = {
            "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 5,
            "leyline": {"session": made["session"], "base_revision": before["revision"],
                        "directives": [directive]},
        }  # fmt: skip
        reply = http.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        edit = reply.json()["leyline"]
        recomputed = math.ceil(0.25 * (len(block) - 4))
        assert edit["path"] == "splice"
        top = reply.json()["choices"][0]["logprobs"]["top_logprobs"][0]
        got = {}
        for text, lp in top.items():
            ids = http.post(Routes.tokenize, json={"text": text}).json()["tokens"]
            if len(ids) == 1:
                got[int(ids[0])] = lp

    engine = Engine(load_model("smollm2"))
    compiled = compile_skill(engine, block, skill_id="x", tenant="t")

    def expected(final: list[int] | None) -> tuple[torch.Tensor, int]:
        session = SessionCache(engine)
        session.prefill(before["tokens"])
        report = session.compose(
            compiled, at, seam_tokens=4, recompute=RecomputeAttention(mode="attention", ratio=0.25),
            final_tokens=final,
        )  # fmt: skip
        session.prefill(prompt)
        return torch.log_softmax(session.next_token_logits().double(), -1), report.prefilled_tokens

    (want, prefilled), (unranked, seam_only) = expected(prompt), expected(None)
    assert prefilled == 4 + recomputed and seam_only == 4
    assert got and all(math.isclose(lp, float(want[t]), abs_tol=2e-3) for t, lp in got.items())
    assert max(abs(lp - float(unranked[t])) for t, lp in got.items()) > 1e-2


def test_an_anchored_skill_composed_after_its_anchor_is_a_prefill_of_both(
    server: Server,
) -> None:
    """``POST /skills`` with an anchor: the block is compiled after the anchor's tokens, so
    composed right after those same tokens (no seam) the session is what a fresh prefill of
    anchor + block computes; checked against transformers' own forward of that text. The
    same block registered without an anchor is measurably further off there."""
    from leyline.engine.models import load_model

    anchor = LOG.split("\n", 1)[0] + "\n"
    with server.client() as http:
        caps = http.get(Routes.capabilities).json()
        assert caps["skill_anchors"] is True
        lead = http.post(Routes.tokenize, json={"text": anchor}).json()["tokens"]
        info = _skill(http, skill="rules-anchored", text=RULES, anchor={"text": anchor})
        plain = _skill(http, skill="rules-alone", text=RULES)
        full = http.get(Routes.skill.format(skill="rules-anchored"), params={"tokens": "true"})
        block = full.json()["tokens"]
        assert info["anchor_tokens"] == len(lead) and full.json()["anchor"] == lead
        assert info["content_hash"] == skill_content_hash(info["model"], block, lead)
        assert plain["content_hash"] == skill_content_hash(info["model"], block)
        got: dict[str, dict[int, float]] = {}
        for skill in ("rules-anchored", "rules-alone"):
            made = _new_session(http, anchor)
            sid = made["session"]
            directive = {"verb": "compose", "skill": skill, "at": len(lead), "seam_tokens": 0}
            reply = http.post(
                Routes.directives.format(session=sid),
                json={"base_revision": made["revision"], "directives": [directive]},
            )
            assert reply.status_code == 200, reply.text
            after = http.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
            assert after["tokens"] == lead + block
            got[skill] = _logprobs(http, sid, lead + block + [28])

    model = load_model("smollm2").model
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([lead + block + [28]])).logits[0, -1]
    want = torch.log_softmax(logits.double(), -1)
    anchored, alone = got["rules-anchored"], got["rules-alone"]
    assert anchored and all(
        math.isclose(lp, float(want[t]), abs_tol=2e-3) for t, lp in anchored.items()
    )
    assert max(abs(lp - float(want[t])) for t, lp in alone.items()) > 1e-2


def test_a_bad_anchor_is_refused_and_nothing_is_registered(server: Server) -> None:
    with server.client() as http:
        for anchor, code in [
            ({"tokens": [10**7]}, "invalid_directive"),
            ({"tokens": [1], "text": "both"}, "invalid_directive"),
            ({}, "invalid_directive"),
        ]:
            reply = http.post(Routes.skills, json={"skill": "bad", "text": RULES, "anchor": anchor})
            assert reply.status_code == 422 and reply.json()["error"]["code"] == code, reply.text
            assert http.get(Routes.skill.format(skill="bad")).status_code == 404


def test_compose_beside_a_splice_and_by_message_anchor(server: Server) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Build it."},
        {"role": "tool", "content": LOG},
        {"role": "user", "content": "Which step was slowest?"},
    ]
    with server.client() as http:
        _skill(http, skill="rules-anchor", text=RULES)
        sid = uuid.uuid4().hex
        made = http.post(Routes.sessions, json={"session": sid, "messages": messages})
        assert made.status_code == 201, made.text
        info = made.json()
        batch = [
            {"verb": "compose", "skill": "rules-anchor", "at": {"message": 1}},
            {"verb": "splice", "span": {"message": 2, "part": "content"},
             "replacement": "[log removed]"},
        ]  # fmt: skip
        reply = http.post(
            Routes.directives.format(session=sid),
            json={"base_revision": info["revision"], "directives": batch},
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["path"] == "splice", body
        (block,) = body["composed"]
        start = info["spans"][1]["start"]
        assert block["start"] == start and block["directive"] == 0
        after = http.get(Routes.session.format(session=sid), params={"tokens": "true"}).json()
        rules = http.get(Routes.skill.format(skill="rules-anchor"), params={"tokens": "true"})
        assert after["tokens"][start : block["end"]] == rules.json()["tokens"]
        assert after["revision"] == info["revision"] + 1


def test_a_rejected_compose_changes_nothing_and_skills_stay_with_their_tenant(
    server: Server,
) -> None:
    with server.client() as http:
        _skill(http, skill="rules-own", text=RULES)
        made = _new_session(http, LOG)
        sid = made["session"]
        url = Routes.session.format(session=sid)
        before = http.get(url, params={"tokens": "true"}).json()
        for directive, code in [
            ({"verb": "compose", "skill": "no-such-skill", "at": 3}, "unknown_skill"),
            ({"verb": "compose", "skill": "rules-own", "at": 10**6}, "invalid_span"),
            ({"verb": "compose", "skill": "rules-own", "at": 3,
              "recompute": {"mode": "deviation", "ratio": 1.5}}, "invalid_directive"),
            ({"verb": "compose", "skill": "rules-own", "at": 3,
              "recompute": {"mode": "everything"}}, "invalid_directive"),
        ]:  # fmt: skip
            reply = http.post(
                Routes.directives.format(session=sid),
                json={"base_revision": before["revision"], "directives": [directive]},
            )
            assert reply.status_code >= 400 and reply.json()["error"]["code"] == code, reply.text
            assert http.get(url, params={"tokens": "true"}).json() == before


@pytest.mark.parametrize("anchored", [False, True])
def test_the_sdk_composes_a_registered_skill_in_a_chat(server: Server, anchored: bool) -> None:
    """The agent-side path on the real server: ``SkillLibrary`` registers a message's block
    (``anchored``: compiled after the rendered context), ``LeylineOpenAI`` sends a compose
    for it in a chat request (with the tail splice the turn needs in the same batch), and
    the block's KV is copied, not prefilled."""
    from .conftest import API_KEY
    from .sdk_compose import chat_with_a_skill

    entry, record = chat_with_a_skill(
        server.base_url, API_KEY, "m", RULES, skill_id="rules-sdk", anchored=anchored
    )
    assert (entry.info.anchor_tokens > 0) is anchored
    assert record.composed == (entry.skill,) and record.resync is None, record
    assert record.path == "splice"
    assert (record.rotated_tokens or 0) >= entry.info.num_tokens - 4  # the block was copied
