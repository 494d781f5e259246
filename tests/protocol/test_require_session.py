"""``options.require_session`` and the ``require_session`` capability: how they travel, and
the conformance check, run against small in-process fake servers (one that honours the
option, and ones that get it wrong)."""

from __future__ import annotations

import json
from urllib.parse import unquote

import httpx
import pytest

from leyline.protocol import Capabilities, LeylineError, LeylineRequest, Verb
from leyline.protocol.conformance import ConformanceSuite
from leyline.protocol.envelope import RequestOptions
from leyline.protocol.errors import ErrorCode
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SessionInfo

from .fake_server import FakeServerBase


def test_an_unset_option_is_not_sent() -> None:
    """A 1.0 server forbids unknown fields: a client that does not set the option sends
    what it sent before the option existed; set, it is sent and read back."""
    assert RequestOptions().model_dump(mode="json") == {
        "infer_splices": False,
        "allow_fallback": True,
    }
    request = LeylineRequest(session="s").model_dump(mode="json", exclude_none=True)
    assert "require_session" not in request["options"]
    splice = {"verb": "splice", "span": {"start": 0, "end": 1}}
    batch = ApplyDirectives.model_validate({"base_revision": 1, "directives": [splice]})
    assert "require_session" not in batch.model_dump(mode="json")["options"]
    sent = LeylineRequest(session="s", options=RequestOptions(require_session=True))
    wire = sent.model_dump_json()
    assert json.loads(wire)["options"]["require_session"] is True
    assert LeylineRequest.model_validate_json(wire) == sent


def test_a_server_that_does_not_send_the_flag_does_not_offer_the_option() -> None:
    assert Capabilities.model_validate({"verbs": ["splice"]}).require_session is False
    offered = Capabilities.model_validate({"verbs": ["splice"], "require_session": True})
    assert offered.require_session is True


class FakeServer(FakeServerBase):
    """Sessions of token ids (text: one token per character); completions append one token.

    ``creates``: a turn on an unknown session with the option creates it anyway and runs;
    ``leaks``: it answers 404 but keeps the session it made; ``refuses_all``: it answers
    404 even for a session that exists.
    """

    def __init__(self, *, advertised: bool = True, fault: str | None = None) -> None:
        self.advertised = advertised
        self.fault = fault
        self.sessions: dict[str, list[int]] = {}
        self.completions = 0

    def _route(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = json.loads(request.content) if request.content else None
        if request.method == "POST" and path == "/v1/completions":
            return self._complete(body)
        parts = [unquote(p) for p in path.split("/")[3:]]
        match request.method, parts:
            case "GET", ["capabilities"]:
                caps = {"verbs": ["splice"], "models": ["fake"]}
                return httpx.Response(200, json=caps | {"require_session": self.advertised})
            case "POST", ["sessions"]:
                create = SessionCreate.model_validate(body)
                assert create.session is not None and create.text is not None
                self.sessions[create.session] = [ord(c) for c in create.text]
                return self._info(create.session, 201)
            case "GET", ["sessions", name]:
                return self._info(name)
            case "DELETE", ["sessions", name]:
                self._tokens(name)
                del self.sessions[name]
                return httpx.Response(204)
        return httpx.Response(404, text="no route")

    def _complete(self, body: dict[str, object]) -> httpx.Response:
        self.completions += 1
        assert body["model"] == "fake" and body["max_tokens"] == 1
        leyline = LeylineRequest.model_validate(body["leyline"])
        name = leyline.session
        assert name is not None
        required = leyline.options.require_session
        known = name in self.sessions
        if required and (not known or self.fault == "refuses_all") and self.fault != "creates":
            if self.fault == "leaks":
                self.sessions[name] = []
            raise LeylineError(ErrorCode.unknown_session, f"no session {name!r}", "session")
        prompt = body["prompt"]
        assert isinstance(prompt, list)
        self.sessions[name] = [*prompt, 7]
        reply = {"session": name, "revision": 1, "path": "reprefill", "reused_tokens": 0,
                 "prefilled_tokens": len(prompt), "rotated_tokens": 0}  # fmt: skip
        return httpx.Response(200, json={"choices": [{"text": "x"}], "leyline": reply})

    def _tokens(self, name: str) -> list[int]:
        if name not in self.sessions:
            raise LeylineError(ErrorCode.unknown_session, f"no session {name!r}", "session")
        return self.sessions[name]

    def _info(self, name: str, status: int = 200) -> httpx.Response:
        tokens = self._tokens(name)
        info = SessionInfo(session=name, revision=1, num_tokens=len(tokens), tokens=tokens)
        return httpx.Response(status, content=info.model_dump_json())


def run_check(server: FakeServer) -> None:
    suite = ConformanceSuite("http://leyline.test")
    transport = httpx.MockTransport(server)
    suite.client._http = httpx.Client(base_url="http://leyline.test", transport=transport)
    suite._raw = httpx.Client(base_url="http://leyline.test", transport=transport)
    try:
        suite.check_capabilities()
        assert Verb.splice in suite.verbs
        suite.check_require_session()
    finally:
        suite.close()


def test_the_check_passes_against_a_server_that_honours_the_option() -> None:
    server = FakeServer()
    run_check(server)
    assert server.completions == 2  # the refused turn, then one on a session that exists
    assert server.sessions == {}  # it cleaned up after itself


@pytest.mark.parametrize(
    ("fault", "failure"),
    [
        ("creates", "not 404 unknown_session"),
        ("leaks", "created the session"),
        ("refuses_all", "HTTP 404"),
    ],
)
def test_the_check_catches_a_server_that_gets_it_wrong(fault: str, failure: str) -> None:
    server = FakeServer(fault=fault)
    with pytest.raises(AssertionError, match=failure):
        run_check(server)
    assert server.sessions == {}  # even then, nothing of the suite's is left behind


def test_the_check_asks_nothing_of_a_server_without_the_flag() -> None:
    server = FakeServer(advertised=False, fault="creates")
    run_check(server)
    assert server.completions == 0
