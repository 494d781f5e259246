"""A Hypothesis-driven fuzz of every route on the live test server (issue 11).

Near-valid bodies (the real request shapes with one part bent: spans in and out of range,
stale and future revisions, anchors, huge and negative numbers, seeds past 64 bits, wrong
types, extra and missing fields, lone surrogates as raw JSON escapes, deep nesting) and
garbage go to every route. After each request the invariants of
``leyline.evals.robustness.checks`` must hold: no 5xx, every error is the protocol's body,
a rejected request leaves the session it names bitwise as it was and creates none, and the
keep-alive connection survives. ``leyline eval robustness`` runs the same fuzzer from a
seeded ``random.Random``; here Hypothesis draws every choice, derandomized (the same
requests on every run). ``LEYLINE_FUZZ_REQUESTS=10000`` runs longer (default 2,000). A
second server with in-place edits off (``LEYLINE_IN_PLACE_EDITS=0``) takes a quarter as many.

Violations are collected, not raised inside Hypothesis: the server is stateful, so a
shrunk replay would not meet the same sessions; each violation carries its exact request.
"""

from __future__ import annotations

import os
import time

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from leyline.evals.robustness.checks import Checker, summarize
from leyline.evals.robustness.fuzz import Fuzzer, Limits
from leyline.evals.robustness.wire import Wire

from .conftest import API_KEY, MAX_BODY, Server

pytestmark = [pytest.mark.slow, pytest.mark.model]

REQUESTS = int(os.environ.get("LEYLINE_FUZZ_REQUESTS", "2000"))


class HypothesisSource:
    """The fuzzer's choices, drawn from Hypothesis (integers shrink toward the valid case)."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def integer(self, low: int, high: int) -> int:
        return self.data.draw(st.integers(low, high))


def test_every_route_keeps_the_invariants_under_fuzz(server: Server) -> None:
    _fuzz(server, REQUESTS)


def test_copy_path_keeps_the_invariants_under_fuzz(copy_server: Server) -> None:
    """The same fuzz, a quarter as long, on a server whose splices build a new KV (in-place
    edits off; the default server moves the sessions' own KV): a rejected request must
    leave the session bitwise as it was on either path."""
    _fuzz(copy_server, REQUESTS // 4)


def _fuzz(server: Server, requests: int) -> None:
    wire = Wire(server.base_url, API_KEY)
    caps = wire.client.get(
        "/leyline/v1/capabilities", headers={"Authorization": f"Bearer {API_KEY}"}
    ).json()["limits"]
    limits = Limits(
        caps["max_directives"], caps["max_replacement_tokens"], MAX_BODY, caps["max_session_tokens"]
    )
    checker = Checker(wire)

    @settings(
        max_examples=requests,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(st.data())
    def one_request(data: st.DataObject) -> None:
        checker.step(Fuzzer(HypothesisSource(data), limits))

    t0 = time.perf_counter()
    try:
        one_request()
        checker.sweep()  # nothing drifted since the last request
    finally:
        checker.cleanup()
        wire.close()
    figures = summarize(checker.tally, time.perf_counter() - t0)
    print(
        f"\nfuzz: {figures['requests']} requests (+{figures['setup_requests']} state reads) in "
        f"{figures['seconds']:.0f} s; statuses {figures['statuses']}; codes {figures['codes']}"
    )
    assert figures["requests"] >= requests, figures["requests"]
    found = "\n".join(
        f"{e['kind']} ({e['status']}): {e['detail']}\n    {e['request']}"
        for e in figures["examples"]
    )
    assert not checker.tally.violations, f"{figures['violations']}\n{found}"
