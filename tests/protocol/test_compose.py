"""COMPOSE: the skills resource, the compose directive, its resolution, errors and clients."""

from __future__ import annotations

import asyncio
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import httpx
import jsonschema
import pytest
from pydantic import ValidationError

from leyline.protocol import (
    Capabilities,
    ComposedBlock,
    ComposeDirective,
    Edit,
    ErrorCode,
    LeylineError,
    LeylineResponse,
    MessagePoint,
    MessageSpan,
    Mode,
    RecomputeAttention,
    RecomputeDeviation,
    RecomputeMode,
    RecomputeNone,
    ResolvedCompose,
    TokenSpan,
    Verb,
    apply_edits,
    parse_directives,
    replacement_spans,
    resolve_batch,
)
from leyline.protocol.client import AsyncLeylineClient, LeylineClient
from leyline.protocol.errors import HTTP_STATUS
from leyline.protocol.resources import (
    Routes,
    SkillCreate,
    SkillInfo,
    SkillList,
    skill_content_hash,
)
from leyline.protocol.schema import build_schema

# -- the skills resource ------------------------------------------------------------------


def test_skill_routes() -> None:
    assert Routes.skills == "/leyline/v1/skills"
    assert Routes.skill.format(skill="s") == "/leyline/v1/skills/s"


@pytest.mark.parametrize(
    "body",
    [
        {"text": "You write SQL in lower case."},
        {"messages": [{"role": "system", "content": "Be terse."}]},
        {"tokens": [1, 2, 3], "skill": "sql", "name": "SQL style", "description": "house rules"},
        {"tokens": [0], "model": "smollm2"},
    ],
)
def test_skill_create_takes_exactly_one_source(body: dict[str, Any]) -> None:
    assert SkillCreate.model_validate(body).model_dump(exclude_none=True) == body


@pytest.mark.parametrize(
    ("body", "where"),
    [
        ({}, "exactly one of"),
        ({"text": "a", "tokens": [1]}, "exactly one of"),
        ({"text": "a", "messages": [{"role": "user", "content": "b"}]}, "exactly one of"),
        ({"text": ""}, "text"),
        ({"tokens": []}, "tokens"),
        ({"messages": []}, "messages"),
        ({"tokens": [1, -2]}, "tokens"),
        ({"tokens": [1], "skill": ""}, "skill"),
        ({"tokens": [1], "skill": "x" * 129}, "skill"),
        ({"tokens": [1], "name": "n" * 257}, "name"),
        ({"tokens": [1], "description": "d" * 4097}, "description"),
        ({"tokens": [1], "add_generation_prompt": True}, "add_generation_prompt"),
        ({"tokens": [1], "cache_salt": "s"}, "cache_salt"),
    ],
)
def test_skill_create_rejects_bad_bodies(body: dict[str, Any], where: str) -> None:
    with pytest.raises(ValidationError, match=where):
        SkillCreate.model_validate(body)


def test_skill_replies_ignore_fields_a_newer_minor_version_adds() -> None:
    info = {"skill": "s", "model": "m", "num_tokens": 2, "content_hash": "ab", "later": 1}
    assert SkillInfo.model_validate(info).tokens is None
    listed = SkillList.model_validate({"skills": [info], "next": None})
    assert [s.skill for s in listed.skills] == ["s"]
    with pytest.raises(ValidationError):
        SkillInfo.model_validate({**info, "num_tokens": 0})  # a skill is never empty


def test_content_hash_is_sha256_over_model_and_ids() -> None:
    expected = hashlib.sha256(b"smollm2\0" + struct.pack("<3q", 1, 22, 333)).hexdigest()
    assert skill_content_hash("smollm2", [1, 22, 333]) == expected
    assert skill_content_hash("smollm2", (1, 22, 333)) == expected
    assert skill_content_hash("other", [1, 22, 333]) != expected
    assert skill_content_hash("smollm2", [1, 22, 334]) != expected
    assert skill_content_hash("smollm2", [12, 2]) != skill_content_hash("smollm2", [1, 22])


def test_an_anchored_content_hash_appends_the_anchor_after_a_marker() -> None:
    block, lead = struct.pack("<3q", 1, 22, 333), struct.pack("<2q", 7, 8)
    expected = hashlib.sha256(b"smollm2\0" + block + b"\0anchor" + lead).hexdigest()
    assert skill_content_hash("smollm2", [1, 22, 333], [7, 8]) == expected
    assert skill_content_hash("smollm2", [1, 22, 333], ()) == skill_content_hash(
        "smollm2", [1, 22, 333]
    )
    # Moving a token between the block and the anchor changes the hash.
    assert skill_content_hash("smollm2", [1, 22], [333, 7, 8]) != expected


@pytest.mark.parametrize(
    "anchor",
    [{}, {"text": "a", "tokens": [1]}, {"tokens": []}, {"text": ""}, {"tokens": [-1]}, {"x": 1}],
)
def test_a_skill_anchor_takes_exactly_one_nonempty_source(anchor: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        SkillCreate.model_validate({"tokens": [1], "anchor": anchor})


def test_anchored_skill_bodies_validate_against_the_schema() -> None:
    body = {"skill": "s", "text": "rules", "anchor": {"messages": [{"role": "system"}]}}
    _validator("SkillCreate").validate(body)
    assert SkillCreate.model_validate(body).anchor is not None
    with pytest.raises(jsonschema.ValidationError):
        _validator("SkillCreate").validate({"tokens": [1], "anchor": {"tokens": [1], "x": 2}})
    info = {"skill": "s", "model": "m", "num_tokens": 3, "content_hash": "0" * 64}
    _validator("SkillInfo").validate({**info, "anchor_tokens": 2, "anchor": [5, 6]})
    assert SkillInfo.model_validate(info).anchor_tokens == 0


# -- the directive ------------------------------------------------------------------------


def test_compose_defaults_and_insertion_point_forms() -> None:
    a, b, c = parse_directives(
        [
            {"verb": "compose", "skill": "s", "at": 12},
            {"verb": "compose", "skill": "s", "at": {"message": 2}},
            {"verb": "compose", "skill": "s", "at": "end", "recompute": {"mode": "deviation"}},
        ]
    )
    assert isinstance(a, ComposeDirective) and isinstance(b, ComposeDirective)
    assert isinstance(c, ComposeDirective)
    assert (a.at, a.seam_tokens, a.recompute) == (12, 4, RecomputeNone(mode="none"))
    assert b.at == MessagePoint(message=2, part="all", edge="start")
    assert c.at == "end" and c.recompute == RecomputeDeviation(mode="deviation", ratio=0.15)
    assert ComposeDirective(skill="s", at=0).recompute.mode == "none"


INVALID, SPAN = ErrorCode.invalid_directive, ErrorCode.invalid_span
MALFORMED: list[tuple[dict[str, Any], ErrorCode, str]] = [
    # A compose directive's fields besides ``verb`` and ``skill``; the error's code, and its
    # field under ``directives[0].``.
    ({"at": -1}, SPAN, "at"),
    ({"at": "start"}, INVALID, "at"),
    ({"at": 1.5}, INVALID, "at"),
    ({"at": None}, INVALID, "at"),
    ({"at": {"message": -1}}, SPAN, "at.message"),
    ({"at": {"message": 1, "x": 0}}, INVALID, "at.x"),
    ({"at": {"message": 1, "edge": "mid"}}, INVALID, "at.edge"),
    ({"at": {"message": 1, "part": "body"}}, INVALID, "at.part"),
    ({"at": {"start": 1, "end": 2}}, INVALID, "at.message"),
    ({"at": 0, "seam_tokens": -1}, INVALID, "seam_tokens"),
    ({"at": 0, "seam_tokens": 257}, INVALID, "seam_tokens"),
    ({"at": 0, "skill": ""}, INVALID, "skill"),
    ({"at": 0, "skill": "x" * 129}, INVALID, "skill"),
    ({"at": 0, "span": {"start": 0, "end": 1}}, INVALID, "span"),
    ({"at": 0, "recompute": {}}, INVALID, "recompute"),
    ({"at": 0, "recompute": {"mode": "all"}}, INVALID, "recompute"),
    ({"at": 0, "recompute": {"mode": "none", "ratio": 0.2}}, INVALID, "recompute.ratio"),
    ({"at": 0, "recompute": {"mode": "deviation", "ratio": 0}}, INVALID, "recompute.ratio"),
    ({"at": 0, "recompute": {"mode": "deviation", "ratio": 1.5}}, INVALID, "recompute.ratio"),
    ({"at": 0, "recompute": {"mode": "attention", "ratio": 0}}, INVALID, "recompute.ratio"),
    (
        {"at": 0, "recompute": {"mode": "attention", "ratio": 0.2, "queries": 9}},
        INVALID,
        "recompute.queries",
    ),
]


@pytest.mark.parametrize(("extra", "code", "field"), MALFORMED)
def test_malformed_compose_names_the_field(
    extra: dict[str, Any], code: ErrorCode, field: str
) -> None:
    with pytest.raises(LeylineError) as info:
        parse_directives([{"verb": "compose", "skill": "s", **extra}])
    assert (info.value.code, info.value.field) == (code, f"directives[0].{field}"), info.value


def test_an_unknown_recompute_mode_is_not_called_a_verb() -> None:
    with pytest.raises(LeylineError) as info:
        parse_directives([{"verb": "compose", "skill": "s", "at": 0, "recompute": {"mode": "x"}}])
    assert "verb" not in info.value.message and "'x'" in info.value.message


@pytest.mark.parametrize(
    "data",
    [
        {"verb": "compose", "skill": "s", "at": 3},
        {"verb": "compose", "skill": "s", "at": {"message": 1, "part": "content", "edge": "end"}},
        {"verb": "compose", "skill": "s", "at": "end", "seam_tokens": 0},
        {
            "verb": "compose",
            "skill": "s",
            "at": 0,
            "recompute": {"mode": "deviation", "ratio": 0.3},
        },
        {"verb": "compose", "skill": "s", "at": "end", "recompute": {"mode": "attention"}},
    ],
)
def test_compose_round_trips_and_validates_against_the_schema(data: dict[str, Any]) -> None:
    (directive,) = parse_directives([data])
    wire = json.loads(directive.model_dump_json())
    assert parse_directives([wire]) == [directive]
    validator = _validator("DirectiveBatch")
    validator.validate([data])
    validator.validate([wire])


@pytest.mark.parametrize(
    "bad",
    [
        {"at": -1},
        {"at": "start"},
        {"at": {"message": 0, "x": 1}},
        {"at": 0, "seam_tokens": 257},
        {"at": 0, "recompute": {"mode": "none", "ratio": 0.2}},
        {"at": 0, "recompute": {"ratio": 0.2}},
        {"at": 0, "recompute": {"mode": "deviation", "ratio": 0}},
        {"at": 0, "recompute": {"mode": "attention", "ratio": 1.01}},
        {},
    ],
)
def test_schema_rejects_what_the_model_rejects(bad: dict[str, Any]) -> None:
    data = {"verb": "compose", "skill": "s", **bad}
    with pytest.raises(LeylineError):
        parse_directives([data])
    with pytest.raises(jsonschema.ValidationError):
        _validator("DirectiveBatch").validate([data])


def test_skill_bodies_validate_against_the_schema() -> None:
    _validator("SkillCreate").validate({"skill": "sql", "text": "rules", "name": "SQL"})
    with pytest.raises(jsonschema.ValidationError):
        _validator("SkillCreate").validate({"tokens": [1], "surprise": 1})
    info = {"skill": "s", "model": "m", "num_tokens": 3, "content_hash": "0" * 64}
    _validator("SkillList").validate({"skills": [info]})
    block = {"directive": 0, "skill": "s", "start": 4, "end": 7}
    reply = {"revision": 1, "path": "splice", "reused_tokens": 1, "prefilled_tokens": 0}
    _validator("LeylineResponse").validate({**reply, "rotated_tokens": 0, "composed": [block]})


def _validator(definition: str) -> jsonschema.Draft202012Validator:
    defs = build_schema()["$defs"]
    return jsonschema.Draft202012Validator({"$defs": defs, "$ref": f"#/$defs/{definition}"})


# -- resolution ---------------------------------------------------------------------------

SKILLS = {"sql": [901, 902, 903], "one": [950]}
SPANS = [
    MessageSpan(message=0, role="system", start=0, end=10, content=TokenSpan(start=3, end=9)),
    MessageSpan(message=1, role="tool", start=10, end=40, content=TokenSpan(start=13, end=39)),
]
ALL = set(Verb)


def resolve(data: list[dict[str, Any]], **kwargs: Any):  # type: ignore[no-untyped-def]
    kwargs.setdefault("supported", ALL)
    kwargs.setdefault("skill_tokens", SKILLS.get)
    return resolve_batch(
        parse_directives(data), length=40, tokenize=_tokenize, spans=SPANS, **kwargs
    )


def _tokenize(text: str) -> Sequence[int]:
    return [ord(c) for c in text]


@pytest.mark.parametrize(
    ("at", "position"),
    [
        (7, 7),
        (0, 0),
        (40, 40),
        ("end", 40),
        ({"message": 1}, 10),
        ({"message": 1, "edge": "end"}, 40),
        ({"message": 0, "edge": "end"}, 10),
        ({"message": 1, "part": "content"}, 13),
        ({"message": 1, "part": "content", "edge": "end"}, 39),
    ],
)
def test_at_resolves_to_a_base_position(at: Any, position: int) -> None:
    batch = resolve([{"verb": "compose", "skill": "sql", "at": at}])
    (edit,) = batch.edits
    assert (edit.start, edit.end, edit.replacement, edit.mode) == (
        position,
        position,
        (901, 902, 903),
        Mode.amortize,
    )
    assert batch.composes == (
        ResolvedCompose(
            index=0,
            skill="sql",
            at=position,
            num_tokens=3,
            seam_tokens=3,  # 4 asked, clamped to the block
            recompute=RecomputeNone(mode="none"),
        ),
    )


@pytest.mark.parametrize(
    ("data", "kwargs", "code", "field"),
    [
        ({"skill": "sql", "at": 41}, {}, ErrorCode.invalid_span, "directives[0].at"),
        (
            {"skill": "sql", "at": {"message": 7}},
            {},
            ErrorCode.unresolved_anchor,
            "directives[0].at",
        ),
        (
            {"skill": "sql", "at": {"message": 0, "part": "tool_calls"}},
            {},
            ErrorCode.unresolved_anchor,
            "directives[0].at",
        ),
        ({"skill": "nope", "at": 0}, {}, ErrorCode.unknown_skill, "directives[0].skill"),
        (
            {"skill": "sql", "at": 0},
            {"skill_tokens": None},
            ErrorCode.unknown_skill,
            "directives[0].skill",
        ),
        (
            {"skill": "sql", "at": 0},
            {"supported": {Verb.splice}},
            ErrorCode.unsupported_verb,
            "directives[0].verb",
        ),
        (
            {"skill": "sql", "at": 0, "recompute": {"mode": "deviation"}},
            {},
            ErrorCode.unsupported_option,
            "directives[0].recompute.mode",
        ),
    ],
)
def test_compose_resolution_errors_are_typed(
    data: dict[str, Any], kwargs: dict[str, Any], code: ErrorCode, field: str
) -> None:
    with pytest.raises(LeylineError) as info:
        resolve([{"verb": "compose", **data}], **kwargs)
    assert (info.value.code, info.value.field) == (code, field), info.value


def test_deviation_recompute_runs_where_the_server_executes_it() -> None:
    data = {"verb": "compose", "skill": "sql", "at": 0, "seam_tokens": 1}
    data["recompute"] = {"mode": "deviation", "ratio": 0.5}
    batch = resolve([data], recompute_modes=set(RecomputeMode))
    (compose,) = batch.composes
    assert compose.recompute == RecomputeDeviation(mode="deviation", ratio=0.5)
    assert compose.seam_tokens == 1


def test_attention_recompute_runs_only_where_the_server_executes_it() -> None:
    data = {"verb": "compose", "skill": "sql", "at": 0, "recompute": {"mode": "attention"}}
    batch = resolve([data], recompute_modes={RecomputeMode.none, RecomputeMode.attention})
    (compose,) = batch.composes
    assert compose.recompute == RecomputeAttention(mode="attention", ratio=0.15)
    with pytest.raises(LeylineError) as info:  # a server that executes deviation only
        resolve([data], recompute_modes={RecomputeMode.none, RecomputeMode.deviation})
    assert info.value.code is ErrorCode.unsupported_option
    assert info.value.field == "directives[0].recompute.mode"


def test_an_unsupported_option_is_refused_before_anything_resolves() -> None:
    with pytest.raises(LeylineError) as info:
        resolve(
            [
                {"verb": "splice", "span": {"start": 0, "end": 99}},  # would be invalid_span
                {"verb": "compose", "skill": "sql", "at": 0, "recompute": {"mode": "deviation"}},
            ]
        )
    assert info.value.code is ErrorCode.unsupported_option
    assert info.value.field == "directives[1].recompute.mode"


def test_a_skill_bound_elsewhere_is_a_mismatch() -> None:
    def bound_to_another_model(skill: str) -> Sequence[int] | None:
        raise LeylineError(ErrorCode.skill_mismatch, f"{skill!r} is bound to model 'other'")

    with pytest.raises(LeylineError) as info:
        resolve([{"verb": "compose", "skill": "sql", "at": 0}], skill_tokens=bound_to_another_model)
    assert info.value.code is ErrorCode.skill_mismatch and info.value.http_status == 409


def test_compose_and_splices_address_the_base_revision_in_one_batch() -> None:
    base = list(range(100, 140))
    batch = resolve(
        [
            {"verb": "splice", "span": {"message": 1, "part": "content"}, "replacement": "ab"},
            {"verb": "compose", "skill": "sql", "at": {"message": 1}},
            {"verb": "splice", "span": {"start": 2, "end": 5}},
            {"verb": "compose", "skill": "one", "at": "end"},
        ]
    )
    result = apply_edits(base, batch.edits)
    expected = (
        *base[:2],
        *base[5:10],
        901,
        902,
        903,
        *base[10:13],
        ord("a"),
        ord("b"),
        base[39],
        950,
    )
    assert result.tokens == expected
    placed = replacement_spans(len(base), batch.edits)
    assert placed[1] == (7, 10) and placed[3] == (16, 17)  # the two blocks, new positions
    assert [result.tokens[s:e] for s, e in (placed[1], placed[3])] == [(901, 902, 903), (950,)]
    assert [c.index for c in batch.composes] == [1, 3]


def test_insertions_at_one_point_keep_batch_order_and_precede_a_span_there() -> None:
    base = list(range(10))
    batch = resolve(
        [
            {"verb": "forget", "span": {"start": 4, "end": 6}, "replacement": [7]},
            {"verb": "compose", "skill": "one", "at": 4},
            {"verb": "compose", "skill": "sql", "at": 4},
        ]
    )
    result = apply_edits(base, batch.edits)
    assert result.tokens == (0, 1, 2, 3, 950, 901, 902, 903, 7, 6, 7, 8, 9)
    assert replacement_spans(len(base), batch.edits) == [(8, 9), (4, 5), (5, 8)]
    # The block is an insertion like any other: after a forget's start, all is recomputed.
    assert [r.kind for r in result.runs] == ["kept", "inserted", "recompute"]


def test_compose_strictly_inside_a_span_overlaps_it() -> None:
    batch = resolve(
        [
            {"verb": "splice", "span": {"message": 1, "part": "content"}},
            {"verb": "compose", "skill": "sql", "at": 20},
        ]
    )
    with pytest.raises(LeylineError) as info:
        apply_edits(list(range(40)), batch.edits)
    assert info.value.code is ErrorCode.overlapping_directives


def test_replacement_spans_follow_the_algebra() -> None:
    edits = [Edit(5, 15, (1, 2)), Edit(0, 0, (9,)), Edit(20, 20, (3, 4, 5))]
    result = apply_edits(list(range(20)), edits)
    spans = replacement_spans(20, edits)
    assert spans == [(6, 8), (0, 1), (13, 16)]
    for edit, (start, end) in zip(edits, spans, strict=True):
        assert result.tokens[start:end] == edit.replacement
    with pytest.raises(LeylineError):
        replacement_spans(20, [Edit(3, 30, ())])


# -- errors and capabilities --------------------------------------------------------------


def test_every_code_has_a_status_and_compose_codes_map_as_documented() -> None:
    assert set(HTTP_STATUS) == set(ErrorCode)
    assert HTTP_STATUS[ErrorCode.unknown_skill] == 404
    assert HTTP_STATUS[ErrorCode.skill_mismatch] == 409
    assert HTTP_STATUS[ErrorCode.unsupported_option] == 501
    error = LeylineError(ErrorCode.unknown_skill, "no skill 'x'", "leyline.directives[0].skill")
    again = LeylineError.from_body(error.to_body())
    assert (again.code, again.field, again.http_status) == (error.code, error.field, 404)


def test_capabilities_default_to_no_skill_limits_and_seam_only_recompute() -> None:
    caps = Capabilities(verbs=[Verb.splice])
    assert caps.compose_recompute == [RecomputeMode.none]
    assert caps.limits.max_skill_tokens is None
    newer = Capabilities.model_validate(
        {"verbs": ["compose"], "compose_recompute": ["none", "deviation"],
         "limits": {"max_skill_tokens": 8192}}
    )  # fmt: skip
    assert newer.compose_recompute == [RecomputeMode.none, RecomputeMode.deviation]
    assert newer.limits.max_skill_tokens == 8192


def test_response_reports_composed_blocks() -> None:
    reply = LeylineResponse.model_validate(
        {"revision": 3, "path": "splice", "reused_tokens": 9, "prefilled_tokens": 4,
         "rotated_tokens": 6, "composed": [{"directive": 1, "skill": "s", "start": 4,
                                            "end": 9, "later": True}]}
    )  # fmt: skip
    assert reply.composed == [ComposedBlock(directive=1, skill="s", start=4, end=9)]
    old = {"revision": 3, "path": "splice", "reused_tokens": 9, "prefilled_tokens": 4}
    assert LeylineResponse.model_validate({**old, "rotated_tokens": 6}).composed == []


# -- clients ------------------------------------------------------------------------------

INFO = SkillInfo(
    skill="sql/v2",
    model="smollm2",
    num_tokens=3,
    content_hash=skill_content_hash("smollm2", [1, 2, 3]),
    name="SQL",
)


def handler(request: httpx.Request) -> httpx.Response:
    route = (request.method, request.url.raw_path.decode())
    if route == ("POST", "/leyline/v1/skills"):
        assert json.loads(request.content) == {
            "skill": "sql/v2",
            "tokens": [1, 2, 3],
            "name": "SQL",
        }
        return httpx.Response(201, content=INFO.model_dump_json())
    if route == ("GET", "/leyline/v1/skills/sql%2Fv2?tokens=true"):
        return httpx.Response(
            200, content=INFO.model_copy(update={"tokens": [1, 2, 3]}).model_dump_json()
        )
    if route == ("GET", "/leyline/v1/skills/sql%2Fv2"):
        return httpx.Response(200, content=INFO.model_dump_json())
    if route == ("GET", "/leyline/v1/skills"):
        return httpx.Response(200, json={"skills": [INFO.model_dump(mode="json")]})
    if route == ("DELETE", "/leyline/v1/skills/sql%2Fv2"):
        return httpx.Response(204)
    if route == ("GET", "/leyline/v1/skills/gone"):
        error = LeylineError(ErrorCode.unknown_skill, "no skill 'gone'", "skill")
        return httpx.Response(404, content=error.to_body().model_dump_json())
    return httpx.Response(500, text=f"unexpected {route}")


def test_sync_client_speaks_the_skill_routes() -> None:
    http = httpx.Client(transport=httpx.MockTransport(handler))
    with LeylineClient("http://leyline.test", http_client=http) as client:
        assert client.create_skill("sql/v2", tokens=[1, 2, 3], name="SQL") == INFO
        assert client.get_skill("sql/v2") == INFO
        assert client.get_skill("sql/v2", include_tokens=True).tokens == [1, 2, 3]
        assert client.list_skills() == [INFO]
        assert client.delete_skill("sql/v2") is None
        with pytest.raises(LeylineError) as info:
            client.get_skill("gone")
        assert info.value.code is ErrorCode.unknown_skill


def test_async_client_speaks_the_skill_routes() -> None:
    async def go() -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(handler))
        async with AsyncLeylineClient("http://leyline.test", http_client=http) as client:
            assert await client.create_skill("sql/v2", tokens=[1, 2, 3], name="SQL") == INFO
            assert (await client.get_skill("sql/v2", include_tokens=True)).tokens == [1, 2, 3]
            assert await client.list_skills() == [INFO]
            assert await client.delete_skill("sql/v2") is None

    asyncio.run(go())


def test_bad_skill_arguments_fail_before_any_request() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no request expected, got {request.method} {request.url}")

    http = httpx.Client(transport=httpx.MockTransport(refuse))
    with LeylineClient("http://leyline.test", http_client=http) as client:
        with pytest.raises(ValueError, match="exactly one of"):
            client.create_skill("s", text="a", tokens=[1])
        with pytest.raises(ValueError, match="exactly one of"):
            client.create_skill("s")
        for call in (client.get_skill, client.delete_skill):
            with pytest.raises(LeylineError) as info:
                call("")
            assert info.value.code is ErrorCode.unknown_skill
