"""The conformance suite's compose checks, run against a small in-process fake server that
follows the protocol with its own reference code (resolve_batch, apply_edits)."""

from __future__ import annotations

import json
from urllib.parse import unquote

import httpx
import pytest

from leyline.protocol import (
    LeylineError,
    LeylineResponse,
    Path,
    RecomputeMode,
    Verb,
    apply_edits,
    resolve_batch,
)
from leyline.protocol.conformance import ConformanceSuite
from leyline.protocol.errors import ErrorCode
from leyline.protocol.resources import (
    ApplyDirectives,
    SessionCreate,
    SessionInfo,
    SkillCreate,
    SkillInfo,
    SkillList,
    skill_content_hash,
)

from .composed_blocks import composed_blocks
from .fake_server import FakeServerBase

MODEL = "fake"


class FakeServer(FakeServerBase):
    """Sessions of token ids (text: one token per character) and skills, one tenant."""

    def __init__(
        self,
        verbs: set[Verb],
        *,
        composed: bool = True,
        listed: frozenset[RecomputeMode] = frozenset({RecomputeMode.none}),
        executed: frozenset[RecomputeMode] | None = None,
    ) -> None:
        self.verbs = verbs
        self.composed = composed  # False: a server that forgets to report blocks
        self.listed = listed  # the recompute modes its capabilities list
        self.executed = listed if executed is None else executed  # those it runs
        self.sessions: dict[str, tuple[list[int], int]] = {}
        self.skills: dict[str, SkillInfo] = {}

    def _route(self, request: httpx.Request) -> httpx.Response:
        parts = [unquote(p) for p in request.url.path.split("/")[3:]]
        body = json.loads(request.content) if request.content else None
        full = request.url.params.get("tokens") == "true"
        match request.method, parts:
            case "GET", ["capabilities"]:
                caps = {"verbs": sorted(self.verbs), "compose_recompute": sorted(self.listed)}
                return httpx.Response(200, json=caps)
            case "POST", ["sessions"]:
                create = SessionCreate.model_validate(body)
                assert create.session is not None and create.text is not None
                self.sessions[create.session] = ([ord(c) for c in create.text], 0)
                return self._info(create.session, False, 201)
            case "GET", ["sessions", name]:
                return self._info(name, full)
            case "DELETE", ["sessions", name]:
                self._session(name)
                del self.sessions[name]
                return httpx.Response(204)
            case "POST", ["sessions", name, "directives"]:
                return self._apply(name, ApplyDirectives.model_validate(body))
            case "POST", ["skills"]:
                create = SkillCreate.model_validate(body)
                assert create.skill is not None and create.tokens is not None
                info = SkillInfo(
                    skill=create.skill,
                    model=MODEL,
                    num_tokens=len(create.tokens),
                    content_hash=skill_content_hash(MODEL, create.tokens),
                    tokens=create.tokens,
                )
                self.skills[create.skill] = info
                return httpx.Response(
                    201, content=info.model_copy(update={"tokens": None}).model_dump_json()
                )
            case "GET", ["skills"]:
                listed = [s.model_copy(update={"tokens": None}) for s in self.skills.values()]
                return httpx.Response(200, content=SkillList(skills=listed).model_dump_json())
            case "GET", ["skills", skill]:
                info = self._skill(skill)
                shown = info if full else info.model_copy(update={"tokens": None})
                return httpx.Response(200, content=shown.model_dump_json())
            case "DELETE", ["skills", skill]:
                self._skill(skill)
                del self.skills[skill]
                return httpx.Response(204)
        return httpx.Response(404, text="no route")

    def _session(self, name: str) -> tuple[list[int], int]:
        if name not in self.sessions:
            raise LeylineError(ErrorCode.unknown_session, f"no session {name!r}", "session")
        return self.sessions[name]

    def _skill(self, skill: str) -> SkillInfo:
        if skill not in self.skills:
            raise LeylineError(ErrorCode.unknown_skill, f"no skill {skill!r}", "skill")
        return self.skills[skill]

    def _info(self, name: str, full: bool, status: int = 200) -> httpx.Response:
        tokens, revision = self._session(name)
        info = SessionInfo(
            session=name,
            revision=revision,
            num_tokens=len(tokens),
            tokens=list(tokens) if full else None,
        )
        return httpx.Response(status, content=info.model_dump_json())

    def _apply(self, name: str, body: ApplyDirectives) -> httpx.Response:
        tokens, revision = self._session(name)
        if body.base_revision != revision:
            raise LeylineError(ErrorCode.revision_conflict, "stale", "base_revision")

        def skill_tokens(skill: str) -> list[int] | None:
            info = self.skills.get(skill)
            return None if info is None else info.tokens

        batch = resolve_batch(
            body.directives,
            length=len(tokens),
            tokenize=lambda text: [ord(c) for c in text],
            supported=self.verbs,
            skill_tokens=skill_tokens,
            recompute_modes=self.executed,
        )
        result = apply_edits(tokens, batch.edits)
        composed = composed_blocks(len(tokens), batch)
        self.sessions[name] = (list(result.tokens), revision + 1)
        reply = LeylineResponse(
            session=name,
            revision=revision + 1,
            path=Path.splice,
            reused_tokens=result.reused_tokens,
            prefilled_tokens=result.prefilled_tokens,
            rotated_tokens=result.rotated_tokens,
            composed=composed if self.composed else [],
        )
        return httpx.Response(200, content=reply.model_dump_json())


def suite_for(server: FakeServer) -> ConformanceSuite:
    suite = ConformanceSuite("http://leyline.test")
    transport = httpx.MockTransport(server)
    suite.client._http = httpx.Client(base_url="http://leyline.test", transport=transport)
    suite._raw = httpx.Client(base_url="http://leyline.test", transport=transport)
    suite.check_capabilities()
    return suite


@pytest.mark.parametrize("verbs", [{Verb.splice}, {Verb.splice, Verb.compose}])
def test_compose_checks_pass_against_a_server_that_follows_the_protocol(verbs: set[Verb]) -> None:
    server = FakeServer(verbs)
    suite = suite_for(server)
    try:
        suite.check_unsupported()
        suite.check_compose()
        suite.check_splice()  # the fake is a fair server beyond compose too
    finally:
        suite.close()
    assert server.sessions == {} and server.skills == {}  # it cleaned up after itself


def test_compose_check_catches_a_missing_composed_report() -> None:
    server = FakeServer({Verb.splice, Verb.compose}, composed=False)
    suite = suite_for(server)
    try:
        with pytest.raises(AssertionError, match="composed is"):
            suite.check_compose()
    finally:
        suite.close()
    assert server.skills == {}


SELECTIVE = frozenset(RecomputeMode)


@pytest.mark.parametrize("listed", [frozenset({RecomputeMode.none}), SELECTIVE])
def test_the_recompute_check_passes_where_listed_modes_run_and_others_are_refused(
    listed: frozenset[RecomputeMode],
) -> None:
    server = FakeServer({Verb.splice, Verb.compose}, listed=listed)
    suite = suite_for(server)
    try:
        suite.check_recompute()
    finally:
        suite.close()
    assert server.sessions == {} and server.skills == {}


@pytest.mark.parametrize(
    ("listed", "executed", "failure"),
    [
        (frozenset({RecomputeMode.none}), SELECTIVE, "accepted"),  # runs what it hides
        (SELECTIVE, frozenset({RecomputeMode.none}), "HTTP 501"),  # lists what it refuses
    ],
)
def test_the_recompute_check_catches_a_server_whose_capabilities_lie(
    listed: frozenset[RecomputeMode], executed: frozenset[RecomputeMode], failure: str
) -> None:
    server = FakeServer({Verb.splice, Verb.compose}, listed=listed, executed=executed)
    suite = suite_for(server)
    try:
        with pytest.raises(AssertionError, match=failure):
            suite.check_recompute()
    finally:
        suite.close()
    assert server.skills == {}
