"""SkillLibrary and the middleware's composes, against a SCRIPTED Leyline server.

``compose_server`` executes the protocol (resolve, apply, the prompt must extend the edited
cache) on the TOY rendering of ``toy_chat``: no model, no torch. The plain-server test uses
the stand-in for "any other OpenAI server" (``plain_server``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest

from leyline.policies import (
    DEFAULT_SKILL_CONTEXT,
    AsyncLeylineOpenAI,
    AsyncSkillLibrary,
    LeylineOpenAI,
    SkillError,
    SkillLibrary,
    plan_directives,
)
from leyline.policies.middleware_wire import failed_skills, support_from_capabilities
from leyline.policies.skill_refs import SKILL_KEY, SkillBlock
from leyline.policies.skills import block_of
from leyline.protocol import (
    ComposeDirective,
    LeylineResponse,
    RecomputeAttention,
    RecomputeDeviation,
    RecomputeMode,
    RecomputeNone,
    SpliceDirective,
    TokenSpan,
    Verb,
    apply_edits,
    resolve_batch,
)

from .compose_server import OPENAI_HTTPX, ComposeServer
from .plain_server import plain_server
from .toy_chat import render, render_with_gaps, tokenize
from .transcripts import assistant, call, system, user

RULES = "Rules of this repository:\n" + "- run the tests before every commit\n" * 12
DOC = "sum_tree.py walks the tree depth first and adds the values of its leaves.\n" * 6


def registered(server: ComposeServer) -> SkillLibrary:
    library = SkillLibrary(server.leyline())
    library.register("rules", RULES, role="user", description="house rules")
    return library


def ask(
    client: LeylineOpenAI, history: list[Any], *, keep_reply: bool = True
) -> LeylineResponse | None:
    """One call; the reply goes back into ``history`` as the agent would send it."""
    completion = client.chat.completions.create(model="toy", messages=history)
    if keep_reply:
        history.append(completion.choices[0].message.model_dump(exclude_none=True))
    leyline = (completion.model_extra or {}).get("leyline")
    return LeylineResponse.model_validate(leyline) if leyline is not None else None


def first_call(
    server: ComposeServer, library: SkillLibrary | None = None, *, keep_reply: bool = True
) -> tuple[SkillLibrary, LeylineOpenAI, list[Any]]:
    """The rules registered (on ``server`` unless ``library`` is given), a wrapper with the
    library on ``server``, and the task's first call made."""
    library = registered(server) if library is None else library
    client = LeylineOpenAI(server.openai(), skills=library)
    history: list[Any] = [system(), user("Fix the failing test.")]
    ask(client, history, keep_reply=keep_reply)
    return library, client, history


def composes(client: LeylineOpenAI) -> list[ComposeDirective]:
    plan = client.episode.last_plan
    assert plan is not None
    return [d for d in plan.directives if isinstance(d, ComposeDirective)]


def test_registration_is_idempotent_and_cut_from_the_servers_rendering() -> None:
    server = ComposeServer()
    library = registered(server)
    first = library.get("rules")
    assert first is not None
    assert library.register("rules", RULES, role="user") is first  # remembered: no request
    assert len(server.registrations) == 1
    elsewhere = SkillLibrary(server.leyline()).register("rules", RULES, role="user")
    assert (elsewhere.skill, elsewhere.info.content_hash) == (first.skill, first.info.content_hash)
    assert list(server.skills) == [first.skill]  # one skill on the server
    # The block: the message's tokens after a context message, as the server renders them.
    rendered = render([*DEFAULT_SKILL_CONTEXT, {"role": "user", "content": RULES}])
    assert first.tokens == tuple(rendered.tokens[rendered.spans[0].end : rendered.spans[1].end])
    assert server.registrations[0]["tokens"] == list(first.tokens)
    changed = library.register("rules", RULES + "- and lint\n", role="user")
    assert changed.skill != first.skill and library.get("rules") is changed
    assert first.skill in server.skills  # sessions composing the old block are not disturbed
    with pytest.raises(SkillError, match="not registered"):
        library.message("nope")
    with pytest.raises(SkillError, match="role"):
        library.register("bad", RULES, role="narrator")


def test_an_anchored_library_sends_the_rendered_context_as_the_anchor() -> None:
    server = ComposeServer()
    plain = registered(server).get("rules")
    anchored = SkillLibrary(server.leyline(), anchored=True)
    entry = anchored.register("rules", RULES, role="user")
    assert plain is not None and entry.tokens == plain.tokens  # the same block
    rendered = render([*DEFAULT_SKILL_CONTEXT, {"role": "user", "content": RULES}])
    sent = server.registrations[-1]
    assert sent["anchor"] == {"tokens": rendered.tokens[: rendered.spans[0].end]}
    assert "anchor" not in server.registrations[0] or server.registrations[0]["anchor"] is None
    # Another anchor, another id: the two libraries never replace each other's block.
    assert entry.skill != plain.skill and {plain.skill, entry.skill} <= set(server.skills)
    assert anchored.register("rules", RULES, role="user") is entry  # remembered


def test_a_new_skill_message_after_the_reply_is_composed_where_it_goes() -> None:
    server = ComposeServer()
    library, client, history = first_call(server)
    cached = len(server.sessions[client.session].tokens)  # prompt, then the reply
    served_end = render(history[:2]).spans[-1].end
    history += [library.message("rules"), user("Now fix it, following the rules.")]
    answer = ask(client, history)

    skill = library.message("rules")[SKILL_KEY]
    plan = client.episode.last_plan
    assert plan is not None
    # The cached generation prompt and reply become the reply message, then the block follows.
    assert isinstance(plan.directives[0], SpliceDirective)
    assert plan.directives[0].span == TokenSpan(start=served_end, end=cached)
    assert composes(client) == [ComposeDirective(skill=str(skill), at=cached, seam_tokens=4)]
    assert len(plan.directives) == 2  # no extra deletion of the tail
    record = client.records[-1]
    assert (record.path, record.composed, record.skill_notes) == ("splice", (skill,), ())
    assert answer is not None
    [block] = answer.composed
    assert (block.start, block.end) == (answer.spans[3].start, answer.spans[3].end)
    assert server.mismatches == [] and server.leaks == []
    assert server.chats[-1]["messages"][3] == {"role": "user", "content": RULES}

    # Once in the session it is an ordinary message: never composed again.
    history.append(user("Go on."))
    ask(client, history)
    assert composes(client) == [] and client.records[-1].composed == ()
    assert client.records[-1].path == "prefix_hit" and server.mismatches == []


def test_a_skill_inserted_between_cached_messages_is_composed_there() -> None:
    server = ComposeServer()
    library, client, history = first_call(server)
    history.insert(1, library.message("rules"))  # before the task; the reply stays sent back
    ask(client, history)
    skill = str(library.message("rules")[SKILL_KEY])
    at = render([system()]).spans[0].end
    plan = client.episode.last_plan
    assert plan is not None and plan.directives == (ComposeDirective(skill=skill, at=at),)
    assert client.records[-1].composed == (skill,)
    assert server.mismatches == [] and server.leaks == []


def test_a_skill_right_after_the_served_messages_replaces_an_unsent_reply() -> None:
    server = ComposeServer()
    library, client, history = first_call(server, keep_reply=False)
    cached = len(server.sessions[client.session].tokens)
    history.append(library.message("rules"))
    ask(client, history)
    plan = client.episode.last_plan
    assert plan is not None
    end = render(history[:2]).spans[-1].end
    skill = str(library.message("rules")[SKILL_KEY])
    assert plan.directives == (
        SpliceDirective(span=TokenSpan(start=end, end=cached)),  # the unsent reply, once
        ComposeDirective(skill=skill, at=cached),
    )
    assert client.records[-1].composed == (skill,) and server.mismatches == []


def test_the_first_call_and_a_plain_server_get_the_text() -> None:
    library = registered(ComposeServer())
    with plain_server() as plain:
        api = openai.OpenAI(base_url=plain.base_url, api_key="t", max_retries=0)
        client = LeylineOpenAI(api, skills=library)
        history: list[Any] = [system(), library.message("rules"), user("Fix it.")]
        ask(client, history)
        history += [library.message("rules"), user("Again.")]
        ask(client, history)
    for body in plain.requests:
        assert "leyline" not in body
        assert body["messages"][1] == {"role": "user", "content": RULES}  # no side field
    assert plain.requests[-1]["messages"][4] == {"role": "user", "content": RULES}
    assert [r.composed for r in client.records] == [(), ()]


def test_a_leyline_server_without_compose_prefills_the_text() -> None:
    server = ComposeServer(compose=False)
    library, client, history = first_call(server, registered(ComposeServer()))
    history += [library.message("rules"), user("Go.")]
    ask(client, history)
    assert composes(client) == [] and client.records[-1].composed == ()
    assert server.chats[-1]["messages"][3] == {"role": "user", "content": RULES}
    assert server.mismatches == [] and server.leaks == []


def test_an_evicted_skill_falls_back_to_the_text_and_is_forgotten() -> None:
    server = ComposeServer()
    library, client, history = first_call(server)
    skill = str(library.message("rules")[SKILL_KEY])
    del server.skills[skill]  # evicted, or the server restarted
    history += [library.message("rules"), user("Go.")]
    ask(client, history)
    record = client.records[-1]
    assert (record.resync, record.composed) == ("unknown_skill", ())
    assert "compose" in str(server.chats[-2]["leyline"]["directives"])
    assert not server.chats[-1]["leyline"].get("directives")  # re-sent as plain messages
    assert server.chats[-1]["messages"][3]["content"] == RULES
    assert "rules" not in library  # not composed again until registered again
    library.register("rules", RULES, role="user")
    assert server.skills and len(server.registrations) == 2
    history += [library.message("rules"), user("Once more.")]
    ask(client, history)
    assert client.records[-1].composed == (skill,) and server.mismatches == []


def test_a_skill_that_renders_otherwise_in_context_goes_as_text_with_a_note() -> None:
    server = ComposeServer()
    library = SkillLibrary(server.leyline())
    # The toy template renders a tool message's call id, so the block holds "doc-1".
    library.register("doc", DOC, role="tool", tool_call_id="doc-1")
    client = LeylineOpenAI(server.openai(), skills=library)
    history: list[Any] = [system(), user("What does sum_tree do?")]
    ask(client, history)
    history += [assistant(call("c1", "read_doc")), library.message("doc", tool_call_id="c1")]
    ask(client, history)
    assert composes(client) == []
    [note] = client.records[-1].skill_notes
    assert "other tokens" in note and "sent as text" in note
    history += [assistant(call("doc-1", "read_doc")), library.message("doc")]
    ask(client, history)
    assert len(composes(client)) == 1 and client.records[-1].skill_notes == ()
    assert server.mismatches == []


def test_an_edited_skill_message_is_just_text() -> None:
    server = ComposeServer()
    library, client, history = first_call(server)
    history += [{**library.message("rules"), "content": RULES + "- except today\n"}]
    ask(client, history)
    assert composes(client) == [] and server.leaks == []
    assert server.chats[-1]["messages"][3]["content"].endswith("- except today\n")


def test_composes_between_cached_messages_on_a_template_with_separators() -> None:
    """Pure planning: the batch turns the cached tokens into exactly the new rendering."""
    rules, note = user(RULES), user("A short note between two skills.")
    doc = {"role": "system", "content": DOC}
    blocks = {
        m["content"]: block_of(render_with_gaps([system("ctx"), m]), 1, "x") for m in (rules, doc)
    }
    old = [system(), user("Fix the failing test."), assistant(text="Looking.")]
    new = [old[0], rules, note, doc, *old[1:]]
    base = render_with_gaps(old)
    skills = {1: SkillBlock("rules", blocks[RULES]), 3: SkillBlock("doc", blocks[DOC])}
    plan = plan_directives(old, new, spans=base.spans, render=render_with_gaps, skills=skills)
    assert [type(d).__name__ for d in plan.directives] == [
        "ComposeDirective",
        "SpliceDirective",
        "ComposeDirective",
    ]
    by_id = {"rules": blocks[RULES], "doc": blocks[DOC]}
    batch = resolve_batch(
        plan.directives,
        length=len(base.tokens),
        tokenize=tokenize,
        spans=base.spans,
        supported=(Verb.splice, Verb.compose),
        skill_tokens=by_id.get,
    )
    assert list(apply_edits(base.tokens, batch.edits).tokens) == render_with_gaps(new).tokens


def test_the_async_wrapper_composes_too() -> None:
    server = ComposeServer()

    async def episode() -> AsyncLeylineOpenAI:
        library = AsyncSkillLibrary(server.async_leyline())
        await library.register("rules", RULES, role="user")
        client = AsyncLeylineOpenAI(server.async_openai(), skills=library)
        history: list[Any] = [system(), user("Fix the failing test.")]
        for extra in ([], [library.message("rules"), user("Go.")]):
            history += extra
            done = await client.chat.completions.create(model="toy", messages=history)
            history.append(done.choices[0].message.model_dump(exclude_none=True))
        return client

    client = asyncio.run(episode())
    assert len(client.records[-1].composed) == 1 and client.records[-1].path == "splice"
    assert server.mismatches == [] and server.leaks == []


def test_support_and_the_skill_an_error_names() -> None:
    caps = {"protocol_version": "1.0", "verbs": ["splice", "compose"]}
    assert support_from_capabilities(caps).compose
    assert not support_from_capabilities({**caps, "verbs": ["splice"]}).compose
    batch = [
        SpliceDirective(span=TokenSpan(start=0, end=1)),
        ComposeDirective(skill="a", at=1),
        ComposeDirective(skill="b", at=1),
    ]
    request = OPENAI_HTTPX.Request("POST", "http://x/v1/chat/completions")
    response = OPENAI_HTTPX.Response(404, request=request)

    def error(code: str, field: str | None) -> openai.APIStatusError:
        body = {"type": "leyline_error", "code": code, "message": "m", "field": field}
        return openai.NotFoundError("m", response=response, body=body)

    assert failed_skills(error("unknown_skill", "directives[2].skill"), batch) == ["b"]
    assert failed_skills(error("skill_mismatch", None), batch) == ["a", "b"]
    assert failed_skills(error("unknown_session", "session"), batch) == []


ATTENTION = RecomputeAttention(mode="attention", ratio=0.3)
DEVIATION = RecomputeDeviation(mode="deviation", ratio=0.2)
EVERY_MODE = (RecomputeMode.none, RecomputeMode.deviation, RecomputeMode.attention)


def sent_composes(server: ComposeServer) -> list[dict[str, Any]]:
    """The compose directives of the last chat request, as they went on the wire."""
    directives = server.chats[-1].get("leyline", {}).get("directives") or []
    return [d for d in directives if d["verb"] == "compose"]


def test_a_compose_without_recompute_is_sent_as_before() -> None:
    server = ComposeServer(recompute=EVERY_MODE)
    library = registered(server)
    entry = library.get("rules")
    assert entry is not None and entry.recompute is None and entry.block().recompute is None
    library, client, history = first_call(server, library)
    cached = len(server.sessions[client.session].tokens)
    history += [library.message("rules"), user("Which rule applies?")]
    ask(client, history)
    skill = entry.skill
    assert composes(client) == [ComposeDirective(skill=skill, at=cached)]
    # The wire JSON of a compose nobody asked a recompute for: the directive's defaults.
    none = {"mode": "none"}
    assert sent_composes(server) == [
        {"verb": "compose", "skill": skill, "at": cached, "seam_tokens": 4, "recompute": none}
    ]
    assert client.records[-1].composed == (skill,) and server.mismatches == []


def test_the_library_recompute_goes_in_each_compose_and_register_overrides_it() -> None:
    server = ComposeServer(recompute=EVERY_MODE)
    library = SkillLibrary(server.leyline(), recompute=ATTENTION)
    rules = library.register("rules", RULES, role="user")
    doc = library.register("doc", DOC, role="user", recompute=DEVIATION)
    assert (rules.recompute, doc.recompute) == (ATTENTION, DEVIATION)
    assert (rules.block().recompute, doc.block().recompute) == (ATTENTION, DEVIATION)
    # Not part of the skill: the same block and id as a library that asks for none.
    plain = SkillLibrary(server.leyline()).register("rules", RULES, role="user")
    assert (plain.skill, plain.tokens) == (rules.skill, rules.tokens)
    assert "recompute" not in server.registrations[0]

    library, client, history = first_call(server, library)
    for name, recompute, wire in (
        ("rules", ATTENTION, {"mode": "attention", "ratio": 0.3}),
        ("doc", DEVIATION, {"mode": "deviation", "ratio": 0.2}),
    ):
        cached = len(server.sessions[client.session].tokens)
        history += [library.message(name), user(f"What does {name} say about this?")]
        answer = ask(client, history)
        skill = str(library.message(name)[SKILL_KEY])
        assert composes(client) == [
            ComposeDirective(skill=skill, at=cached, seam_tokens=4, recompute=recompute)
        ]
        assert sent_composes(server) == [
            {"verb": "compose", "skill": skill, "at": cached, "seam_tokens": 4, "recompute": wire}
        ]
        record = client.records[-1]
        assert (record.path, record.composed, record.resync) == ("splice", (skill,), None)
        assert answer is not None and [b.skill for b in answer.composed] == [skill]
    assert server.mismatches == [] and server.leaks == []


def test_registering_again_with_another_recompute_updates_the_entry_only() -> None:
    server = ComposeServer(recompute=EVERY_MODE)
    library = registered(server)
    first = library.get("rules")
    assert first is not None
    again = library.register("rules", RULES, role="user", recompute=ATTENTION)
    assert len(server.registrations) == 1  # the server's block is the same: no request
    assert (again.skill, again.tokens, again.info) == (first.skill, first.tokens, first.info)
    assert again.recompute == ATTENTION and library.get("rules") is again
    block = library.lookup(library.message("rules"))
    assert block is not None and block.recompute == ATTENTION
    assert library.register("rules", RULES, role="user", recompute=ATTENTION) is again
    # Each register says the options of the composes to come: none given, the library's.
    seam = library.register("rules", RULES, role="user", seam_tokens=8)
    assert (seam.seam_tokens, seam.recompute) == (8, None)
    block = library.lookup(library.message("rules"))
    assert block is not None and (block.seam_tokens, block.recompute) == (8, None)
    assert len(server.registrations) == 1


def test_a_server_without_the_recompute_mode_gets_the_text() -> None:
    server = ComposeServer()  # compose_recompute: none only
    library = SkillLibrary(server.leyline(), recompute=ATTENTION)
    library.register("rules", RULES, role="user")
    library.register("doc", DOC, role="user", recompute=RecomputeNone(mode="none"))
    library, client, history = first_call(server, library)
    history += [library.message("rules"), user("Go.")]
    ask(client, history)
    record = client.records[-1]
    # Not a compose the server would refuse (and a resync): the message is prefilled.
    assert composes(client) == [] and (record.composed, record.resync) == ((), None)
    assert server.chats[-1]["messages"][3] == {"role": "user", "content": RULES}
    assert "rules" in library  # still registered: a server with the mode composes it
    # A skill that asks for none (overriding the library) is composed here.
    history += [library.message("doc"), user("And now?")]
    ask(client, history)
    skill = str(library.message("doc")[SKILL_KEY])
    assert [d["recompute"] for d in sent_composes(server)] == [{"mode": "none"}]
    assert client.records[-1].composed == (skill,) and client.records[-1].resync is None
    assert server.mismatches == [] and server.leaks == []


def test_the_async_library_carries_recompute_too() -> None:
    server = ComposeServer(recompute=EVERY_MODE)

    async def episode() -> tuple[AsyncSkillLibrary, AsyncLeylineOpenAI]:
        library = AsyncSkillLibrary(server.async_leyline(), recompute=DEVIATION)
        await library.register("rules", RULES, role="user", recompute=ATTENTION)
        await library.register("doc", DOC, role="user")
        client = AsyncLeylineOpenAI(server.async_openai(), skills=library)
        history: list[Any] = [system(), user("Fix the failing test.")]
        for extra in ([], [library.message("rules"), library.message("doc"), user("Go.")]):
            history += extra
            done = await client.chat.completions.create(model="toy", messages=history)
            history.append(done.choices[0].message.model_dump(exclude_none=True))
        return library, client

    library, client = asyncio.run(episode())
    ids = [str(library.message(name)[SKILL_KEY]) for name in ("rules", "doc")]
    assert list(client.records[-1].composed) == ids
    assert [(d["skill"], d["recompute"]) for d in sent_composes(server)] == [
        (ids[0], {"mode": "attention", "ratio": 0.3}),
        (ids[1], {"mode": "deviation", "ratio": 0.2}),
    ]
    assert server.mismatches == [] and server.leaks == []
