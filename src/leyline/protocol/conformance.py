"""A conformance suite any Leyline server can be run against: ``leyline conformance URL``.

Model-agnostic: it works in token ids, checks every result against the protocol's own edit
algebra, and checks that every rejected batch leaves the session exactly as it was. It
creates and deletes its own sessions and skills (named ``conformance-*``).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import ValidationError

from .algebra import Edit, apply_edits
from .capabilities import PROTOCOL_VERSION, Capabilities, is_compatible
from .client import LeylineClient
from .directives import Mode, RecomputeMode, Verb
from .envelope import ComposedBlock, LeylineResponse
from .errors import ErrorCode, ErrorEnvelope, LeylineError
from .resources import Routes, SessionInfo, SkillAnchor, skill_content_hash

_TEXT = (
    "The quick brown fox jumps over the lazy dog while the cat watches from the warm "
    "windowsill and the bird sings a long song about the morning sun."
)


@dataclass(frozen=True, slots=True)
class CheckResult:
    name: str
    passed: bool
    detail: str = ""


class _Failed(AssertionError):
    pass


def _expect(condition: bool, detail: str) -> None:
    if not condition:
        raise _Failed(detail)


class ConformanceSuite:
    def __init__(self, base_url: str, *, api_key: str | None = None, timeout: float = 300) -> None:
        self.base_url = base_url
        self.client = LeylineClient(base_url, api_key=api_key, timeout=timeout)
        self._raw = httpx.Client(
            base_url=base_url,
            timeout=timeout,
            headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        )
        self.verbs: set[Verb] = set()
        self.skill_anchors = False
        self.recompute_modes: set[RecomputeMode] = {RecomputeMode.none}
        self.require_session = False
        self.models: list[str] = []

    def checks(self) -> list[tuple[str, Callable[[], None]]]:
        return [
            ("capabilities are compatible", self.check_capabilities),
            ("session holds what was sent", self.check_session),
            ("splice follows the edit algebra", self.check_splice),
            ("forget follows the edit algebra and re-prefills", self.check_forget),
            ("erratum appends and keeps the prefix", self.check_erratum),
            ("a batch applies all at once", self.check_batch),
            ("identity splice changes no token", self.check_identity),
            ("stale revision: 409, nothing changed", self.check_conflict),
            ("bad batches: typed errors, nothing changed", self.check_rejections),
            ("unsupported verbs are refused, never ignored", self.check_unsupported),
            ("compose inserts a registered skill", self.check_compose),
            ("skill anchors are honoured or refused", self.check_skill_anchor),
            ("recompute modes are executed or refused", self.check_recompute),
            ("a pin refuses edits that touch it and moves with others", self.check_retention),
            ("deleted sessions are gone", self.check_delete),
            ("require_session: an unknown session is 404, not created", self.check_require_session),
            ("schema is served", self.check_schema),
        ]

    def run(self) -> list[CheckResult]:
        if (refused := self.probe()) is not None:
            return [refused]  # every check would fail the same way
        results = []
        for name, check in self.checks():
            try:
                check()
                results.append(CheckResult(name, True))
            except Exception as exc:  # a check that crashes fails; the suite goes on
                results.append(CheckResult(name, False, f"{type(exc).__name__}: {exc}"))
        return results

    def probe(self) -> CheckResult | None:
        """One request first, so a wrong URL is one clear failure rather than twelve."""
        name, path = "the server speaks Leyline", Routes.capabilities
        try:
            reply = self._raw.get(path)
        except httpx.HTTPError as exc:
            return CheckResult(name, False, f"cannot connect to {self.base_url}: {exc}")
        try:
            if reply.is_success:
                Capabilities.model_validate_json(reply.content)
                return None
            error = ErrorEnvelope.model_validate_json(reply.content).error
        except ValidationError:
            kind = reply.headers.get("content-type", "no content type")
            return CheckResult(
                name,
                False,
                f"not a Leyline server: GET {path} answered HTTP {reply.status_code} ({kind}) "
                "without the protocol's body",
            )
        return CheckResult(name, False, f"GET {path} answered {error.code}: {error.message}")

    def close(self) -> None:
        self.client.close()
        self._raw.close()

    # -- helpers --------------------------------------------------------------------------

    @contextmanager
    def _session(self) -> Iterator[SessionInfo]:
        name = f"conformance-{uuid.uuid4().hex[:10]}"
        self.client.create_session(name, text=_TEXT)
        try:
            yield self.client.get_session(name, include_tokens=True)
        finally:
            with suppress(LeylineError):
                self.client.delete_session(name)

    def _apply_and_compare(
        self, info: SessionInfo, edits: list[Edit], raw: list[Any], *, changes: bool = True
    ) -> LeylineResponse:
        assert info.tokens is not None
        expected = apply_edits(info.tokens, edits)
        reply = self._raw.post(
            Routes.directives.format(session=info.session),
            json={"base_revision": info.revision, "directives": raw},
        )
        _expect(reply.status_code == 200, f"HTTP {reply.status_code}: {reply.text[:300]}")
        after = self.client.get_session(info.session, include_tokens=True)
        _expect(after.tokens == list(expected.tokens), "tokens differ from the edit algebra's")
        if changes:  # a batch that changes no token need not bump the revision
            _expect(after.revision > info.revision, "revision did not advance")
        body = reply.json()
        total = body["reused_tokens"] + body["prefilled_tokens"]
        _expect(total == len(expected.tokens), f"reused + prefilled = {total}, not the length")
        if any(e.mode == Mode.forget for e in edits):
            _expect(body["path"] == "reprefill", f"forget answered path {body['path']}")
        return LeylineResponse.model_validate(body)

    def _rejected(self, info: SessionInfo, body: dict[str, Any], code: ErrorCode) -> None:
        reply = self._raw.post(Routes.directives.format(session=info.session), json=body)
        _expect(reply.status_code >= 400, f"accepted: {reply.text[:200]}")
        got = reply.json().get("error", {}).get("code")
        _expect(got == code, f"expected {code}, got {got} ({reply.status_code})")
        after = self.client.get_session(info.session, include_tokens=True)
        _expect(after == info, f"{code}: the session changed")

    # -- checks ---------------------------------------------------------------------------

    def check_capabilities(self) -> None:
        caps = self.client.capabilities()
        _expect(
            is_compatible(PROTOCOL_VERSION, caps.protocol_version),
            f"server speaks {caps.protocol_version}, suite {PROTOCOL_VERSION}",
        )
        self.verbs = set(caps.verbs)
        self.skill_anchors = caps.skill_anchors
        self.recompute_modes = set(caps.compose_recompute)
        self.require_session = caps.require_session
        self.models = list(caps.models)
        _expect(
            Verb.splice in self.verbs or Verb.forget in self.verbs,
            "the server executes neither splice nor forget",
        )

    def check_session(self) -> None:
        with self._session() as info:
            _expect(info.tokens == self.client.tokenize(_TEXT).tokens, "tokens differ")
            _expect(info.num_tokens == len(info.tokens or []), "num_tokens is wrong")

    def check_splice(self) -> None:
        with self._session() as info:
            raw = [{"verb": "splice", "span": {"start": 3, "end": 9}, "replacement": [11, 12]}]
            self._apply_and_compare(info, [Edit(3, 9, (11, 12), Mode.amortize)], raw)

    def check_forget(self) -> None:
        with self._session() as info:
            raw = [{"verb": "forget", "span": {"start": 4, "end": 7}, "replacement": []}]
            self._apply_and_compare(info, [Edit(4, 7, (), Mode.forget)], raw)

    def check_erratum(self) -> None:
        with self._session() as info:
            n = info.num_tokens
            note = list(self.client.tokenize(" [STATE UPDATE] fox -> wolf.").tokens)
            raw = [{"verb": "erratum", "text": note}]
            self._apply_and_compare(info, [Edit(n, n, tuple(note), Mode.amortize)], raw)

    def check_batch(self) -> None:
        with self._session() as info:
            raw = [
                {"verb": "splice", "span": {"start": 10, "end": 14}, "replacement": [21]},
                {"verb": "splice", "span": {"start": 2, "end": 4}, "replacement": []},
                {"verb": "splice", "span": {"start": 6, "end": 6}, "replacement": [22, 23]},
            ]
            edits = [
                Edit(10, 14, (21,), index=0),
                Edit(2, 4, (), index=1),
                Edit(6, 6, (22, 23), index=2),
            ]
            self._apply_and_compare(info, edits, raw)

    def check_identity(self) -> None:
        with self._session() as info:
            assert info.tokens is not None
            same = info.tokens[5:9]
            raw = [{"verb": "splice", "span": {"start": 5, "end": 9}, "replacement": same}]
            self._apply_and_compare(info, [Edit(5, 9, tuple(same))], raw, changes=False)

    def check_conflict(self) -> None:
        with self._session() as info:
            body = {
                "base_revision": info.revision + 5,
                "directives": [{"verb": "forget", "span": {"start": 1, "end": 2}}],
            }
            self._rejected(info, body, ErrorCode.revision_conflict)

    def check_rejections(self) -> None:
        with self._session() as info:
            n, r = info.num_tokens, info.revision
            span = {"verb": "splice", "span": {"start": 1, "end": 3}}
            cases = [
                ([{"verb": "splice", "span": {"start": 2, "end": n + 3}}], ErrorCode.invalid_span),
                ([{"verb": "splice", "span": {"start": 5, "end": 2}}], ErrorCode.invalid_span),
                (
                    [span, {"verb": "splice", "span": {"start": 2, "end": 4}}],
                    ErrorCode.overlapping_directives,
                ),
                ([{"verb": "rewind", "span": {"start": 0, "end": 1}}], ErrorCode.invalid_directive),
                ([span | {"surprise": True}], ErrorCode.invalid_directive),
                ([{"verb": "splice", "span": {"start": 3, "end": 3}}], ErrorCode.invalid_span),
                ([], ErrorCode.empty_batch),
            ]
            for directives, code in cases:
                self._rejected(info, {"base_revision": r, "directives": directives}, code)

    def check_unsupported(self) -> None:
        missing = [
            v for v in (Verb.pin, Verb.unpin, Verb.decay, Verb.scratch) if v not in self.verbs
        ]
        with self._session() as info:
            for verb in missing:
                body = {
                    "base_revision": info.revision,
                    "directives": [{"verb": verb.value, "span": {"start": 0, "end": 1}}],
                }
                self._rejected(info, body, ErrorCode.unsupported_verb)
            if Verb.compose not in self.verbs:
                compose = {"verb": "compose", "skill": "conformance-none", "at": 0}
                body = {"base_revision": info.revision, "directives": [compose]}
                self._rejected(info, body, ErrorCode.unsupported_verb)

    def check_compose(self) -> None:
        """Only where compose is advertised (check_unsupported covers its refusal)."""
        if Verb.compose not in self.verbs:
            return
        skill = f"conformance-{uuid.uuid4().hex[:10]}"
        with self._session() as info:
            assert info.tokens is not None
            block = info.tokens[2:7]  # ids this server's tokenizer produced
            made = self.client.create_skill(skill, tokens=block)
            try:
                _expect(made.skill == skill and made.num_tokens == len(block), f"got {made}")
                _expect(
                    made.content_hash == skill_content_hash(made.model, block),
                    "content_hash is not skill_content_hash(model, tokens)",
                )
                got = self.client.get_skill(skill, include_tokens=True)
                _expect(got.tokens == block, "the skill's tokens differ from those sent")
                listed = [s.skill for s in self.client.list_skills()]
                _expect(skill in listed, "the skill is not listed")
                raw = [{"verb": "compose", "skill": skill, "at": 4, "seam_tokens": 2}]
                reply = self._apply_and_compare(info, [Edit(4, 4, tuple(block))], raw)
                placed = ComposedBlock(directive=0, skill=skill, start=4, end=4 + len(block))
                _expect(reply.composed == [placed], f"composed is {reply.composed}")
                now = self.client.get_session(info.session, include_tokens=True)
                unknown = {"verb": "compose", "skill": f"{skill}-missing", "at": 0}
                body = {"base_revision": now.revision, "directives": [unknown]}
                self._rejected(now, body, ErrorCode.unknown_skill)
            finally:
                with suppress(LeylineError):
                    self.client.delete_skill(skill)
        self._expect_no_skill(skill, "a deleted skill is still there")

    def check_skill_anchor(self) -> None:
        """Where compose is advertised: a skill with an anchor is registered as the anchored
        block (its own content hash) when ``skill_anchors`` is advertised, else refused
        with ``unsupported_option`` and not kept."""
        if Verb.compose not in self.verbs:
            return
        skill = f"conformance-{uuid.uuid4().hex[:10]}"
        with self._session() as info:
            assert info.tokens is not None
            lead, block = info.tokens[:2], info.tokens[2:7]
            if not self.skill_anchors:
                try:
                    self.client.create_skill(skill, tokens=block, anchor=SkillAnchor(tokens=lead))
                except LeylineError as exc:
                    _expect(exc.code is ErrorCode.unsupported_option, f"got {exc.code}")
                    self._expect_no_skill(skill, "a refused anchored skill was kept")
                    return
                with suppress(LeylineError):
                    self.client.delete_skill(skill)
                raise _Failed("an anchor was accepted where skill_anchors is false")
            made = self.client.create_skill(skill, tokens=block, anchor=SkillAnchor(tokens=lead))
            try:
                _expect(made.num_tokens == len(block), f"num_tokens {made.num_tokens}")
                _expect(made.anchor_tokens == len(lead), f"anchor_tokens {made.anchor_tokens}")
                _expect(
                    made.content_hash == skill_content_hash(made.model, block, lead)
                    and made.content_hash != skill_content_hash(made.model, block),
                    "content_hash is not skill_content_hash(model, tokens, anchor)",
                )
                got = self.client.get_skill(skill, include_tokens=True)
                _expect(got.tokens == block and got.anchor == lead, "tokens or anchor differ")
                raw = [{"verb": "compose", "skill": skill, "at": 4, "seam_tokens": 0}]
                self._apply_and_compare(info, [Edit(4, 4, tuple(block))], raw)
            finally:
                with suppress(LeylineError):
                    self.client.delete_skill(skill)

    def check_recompute(self) -> None:
        """Where compose is advertised: each selective recompute mode the capabilities list
        runs (the block lands where the edit algebra puts it, mid-session so tokens follow
        it); each one they do not list is refused with ``unsupported_option``, nothing
        changed, never run as another mode."""
        if Verb.compose not in self.verbs:
            return
        skill = f"conformance-{uuid.uuid4().hex[:10]}"
        with self._session() as info:
            assert info.tokens is not None
            block = info.tokens[2:7]
            self.client.create_skill(skill, tokens=block)
            try:
                for mode in (RecomputeMode.deviation, RecomputeMode.attention):
                    now = self.client.get_session(info.session, include_tokens=True)
                    recompute = {"mode": mode.value, "ratio": 0.5}
                    raw = [{"verb": "compose", "skill": skill, "at": 4, "seam_tokens": 1,
                            "recompute": recompute}]  # fmt: skip
                    if mode in self.recompute_modes:
                        self._apply_and_compare(now, [Edit(4, 4, tuple(block))], raw)
                    else:
                        body = {"base_revision": now.revision, "directives": raw}
                        self._rejected(now, body, ErrorCode.unsupported_option)
            finally:
                with suppress(LeylineError):
                    self.client.delete_skill(skill)

    def _expect_no_skill(self, skill: str, failure: str) -> None:
        try:
            self.client.get_skill(skill)
        except LeylineError as exc:
            _expect(exc.code is ErrorCode.unknown_skill, f"got {exc.code}")
            return
        raise _Failed(failure)

    def check_retention(self) -> None:
        """Only where pin is advertised (check_unsupported covers its refusal)."""
        if Verb.pin not in self.verbs:
            return
        with self._session() as info:
            assert info.tokens is not None
            pin = [{"verb": "pin", "span": {"start": 6, "end": 10}}]
            self._apply_and_compare(info, [], pin, changes=False)
            pinned = self.client.get_session(info.session, include_tokens=True)
            marks = [(m.verb, m.start, m.end) for m in pinned.marks]
            _expect(marks == [("pin", 6, 10)], f"marks are {marks}")
            for start, end in ((8, 12), (9, 9), (4, 7)):  # overlapping, inside, overlapping
                raw = [{"verb": "splice", "span": {"start": start, "end": end}, "replacement": [5]}]
                body = {"base_revision": pinned.revision, "directives": raw}
                self._rejected(pinned, body, ErrorCode.pinned_span)
            decay = [{"verb": "decay", "span": {"start": 9, "end": 12}}]
            body = {"base_revision": pinned.revision, "directives": decay}
            self._rejected(pinned, body, ErrorCode.pinned_span)
            # An edit before it moves it with its tokens.
            raw = [{"verb": "splice", "span": {"start": 1, "end": 4}, "replacement": [7]}]
            self._apply_and_compare(pinned, [Edit(1, 4, (7,))], raw)
            moved = self.client.get_session(info.session, include_tokens=True)
            assert moved.tokens is not None
            marks = [(m.verb, m.start, m.end) for m in moved.marks]
            _expect(marks == [("pin", 4, 8)], f"the pin did not move with its tokens: {marks}")
            _expect(moved.tokens[4:8] == info.tokens[6:10], "the pinned tokens changed")
            unpin = [{"verb": "unpin", "span": {"start": 4, "end": 5}}]
            self._apply_and_compare(moved, [], unpin, changes=False)
            left = self.client.get_session(info.session).marks
            _expect(left == [], f"unpin left {left}")

    def check_delete(self) -> None:
        name = f"conformance-{uuid.uuid4().hex[:10]}"
        self.client.create_session(name, text=_TEXT)
        self.client.delete_session(name)
        try:
            self.client.get_session(name)
        except LeylineError as exc:
            _expect(exc.code is ErrorCode.unknown_session, f"got {exc.code}")
            return
        raise _Failed("a deleted session is still there")

    def check_require_session(self) -> None:
        """Only where ``require_session`` is advertised: a completion naming an unknown
        session with ``options.require_session`` is 404 ``unknown_session`` and creates
        nothing; on a session that exists the option changes nothing (the turn runs)."""
        if not self.require_session:
            return
        with self._session() as info:
            assert info.tokens is not None
            missing = f"conformance-{uuid.uuid4().hex[:10]}"
            reply = self._complete(info.tokens, missing, require_session=True)
            created = self._delete_if_there(missing)
            got = reply.json().get("error", {}).get("code") if reply.content else None
            _expect(
                reply.status_code == 404 and got == ErrorCode.unknown_session,
                f"an unknown session answered HTTP {reply.status_code} ({got}), not 404 "
                f"unknown_session: {reply.text[:200]}",
            )
            _expect(not created, "a refused turn with require_session created the session")
            reply = self._complete(info.tokens, info.session, require_session=True)
            _expect(reply.status_code == 200, f"HTTP {reply.status_code}: {reply.text[:300]}")
            ran = reply.json().get("leyline", {}).get("session")
            _expect(ran == info.session, f"the turn ran in session {ran!r}")

    def _delete_if_there(self, session: str) -> bool:
        """Whether ``session`` existed (then deleted, so the suite leaves nothing behind)."""
        try:
            self.client.get_session(session)
        except LeylineError as exc:
            _expect(exc.code is ErrorCode.unknown_session, f"got {exc.code}")
            return False
        with suppress(LeylineError):
            self.client.delete_session(session)
        return True

    def _complete(self, prompt: list[int], session: str, **options: bool) -> httpx.Response:
        """A one-token completion of ``prompt`` in ``session`` (token ids: model-agnostic)."""
        body: dict[str, Any] = {
            "prompt": prompt,
            "max_tokens": 1,
            "temperature": 0,
            "leyline": {"session": session, "options": options},
        }
        if self.models:
            body["model"] = self.models[0]
        return self._raw.post("/v1/completions", json=body)

    def check_schema(self) -> None:
        schema = self.client.schema()
        _expect("SpliceDirective" in schema.get("$defs", {}), "no SpliceDirective in $defs")


def run_conformance(base_url: str, *, api_key: str | None = None) -> list[CheckResult]:
    suite = ConformanceSuite(base_url, api_key=api_key)
    try:
        return suite.run()
    finally:
        suite.close()
