"""The protocol's promises under fuzzed input, on the live server.

``leyline eval robustness``'s fuzzer and checks (``evals.robustness``), pointed at the
plugin: near-valid and garbage requests to every ``/leyline/v1`` route (directive batches
with compose among them, sessions, skills, tokenize), one at a time over one keep-alive
connection. Checked after each: no 5xx, every error is exactly the protocol's body for its
code, a rejected request leaves the session and the skills it names as they were and
creates none, the connection survives. The host's own routes (``/v1/...`` without a
``leyline`` object) answer with the host's bodies and are not drawn here.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx

from leyline.evals.robustness.checks import Checker, summarize
from leyline.evals.robustness.fuzz import Fuzzer, Limits
from leyline.evals.robustness.source import RandomSource
from leyline.evals.robustness.wire import Wire
from leyline.protocol.resources import Routes

from ._live import record

REQUESTS = int(os.environ.get("LEYLINE_LIVE_FUZZ_REQUESTS", "2000"))


def test_fuzzed_leyline_requests_keep_the_protocols_promises(
    server: httpx.Client, url: str, report_path: Path | None
) -> None:
    caps = server.get(Routes.capabilities).json()
    assert "compose" in caps["verbs"], caps["verbs"]  # so skills and composes are drawn
    cap = int(caps["limits"]["max_session_tokens"])
    wire = Wire(url, None)
    checker = Checker(wire)
    fuzzer = Fuzzer(RandomSource(7), Limits(8, 64, 256 * 1024, cap))
    sent = 0
    try:
        while sent < REQUESTS:
            checker.prepare()
            call = fuzzer.next(checker.views)
            if not call.route.startswith("/leyline/v1/"):
                continue  # the host's own route: its answers are the host's
            checker.run(call)
            sent += 1
        checker.sweep()
    finally:
        checker.cleanup()
        wire.close()
    figures = summarize(checker.tally, 0.0)
    record(
        report_path, check="fuzzed /leyline/v1 requests", requests=sent,
        statuses=dict(sorted(checker.tally.statuses.items())),
        violations=len(checker.tally.violations),
    )  # fmt: skip
    assert not checker.tally.violations, figures.get("examples", figures)
