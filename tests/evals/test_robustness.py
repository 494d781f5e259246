"""`leyline eval robustness`: its checks catch what they claim to, and a --fast run on the
embedded server reports zero failures of every kind."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from leyline.evals.robustness.checks import Checker
from leyline.evals.robustness.cli import SIZES
from leyline.evals.robustness.fuzz import Call, Fuzzer, Limits
from leyline.evals.robustness.races import Write, _verdict
from leyline.evals.robustness.report import counts
from leyline.evals.robustness.source import RandomSource
from leyline.evals.robustness.wire import Outcome

LIMITS = Limits(8, 64, 200_000, 1024)
ERROR = {"type": "leyline_error", "code": "invalid_span", "message": "no", "field": "x"}


class ScriptedWire:
    """A server in a dict: GETs read ``state``; the next fuzzed call gets ``reply`` and may
    change ``state`` (as a buggy server would)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {"session": "fz-0", "revision": 1, "num_tokens": 3,
                                      "tokens": [1, 2, 3], "spans": []}  # fmt: skip
        self.reply = Outcome(422, json.dumps({"error": ERROR}).encode(), "", 0.0, 1)
        self.mutate = False

    def send(self, method: str, path: str, body: bytes | None = None, auth: str = "key") -> Outcome:
        if method == "GET" and path.endswith("?tokens=true"):
            found = path.startswith("/leyline/v1/sessions/fz-0?")
            body = json.dumps(self.state).encode() if found else b""
            return Outcome(200 if found else 404, body, "application/json", 0.0, 1)
        if self.mutate:
            self.state = self.state | {"revision": 2}
        return self.reply


def checked(wire: ScriptedWire) -> list[str]:
    checker = Checker(wire)  # type: ignore[arg-type]
    checker.views = {"fz-0": dict(wire.state), "fz-1": None, "fz-new": None, "fz ü": None}
    call = Call("POST", "/leyline/v1/sessions/fz-0/directives", "r", b"{}", "fz-0")
    checker.run(call)
    return [v.kind for v in checker.tally.violations]


def test_the_checker_flags_each_broken_invariant() -> None:
    wire = ScriptedWire()
    assert checked(wire) == []  # a typed 422 that changed nothing
    wire.mutate = True
    assert checked(wire) == ["state change"]
    wire = ScriptedWire()
    wire.reply = Outcome(500, json.dumps({"error": ERROR | {"code": "internal_error"}}).encode(),
                         "", 0.0, 1)  # fmt: skip
    assert checked(wire) == ["5xx"]
    wire.reply = Outcome(422, b'{"detail": "Not Found"}', "", 0.0, 1)
    assert checked(wire) == ["error body"]
    wire.reply = Outcome(404, json.dumps({"error": ERROR}).encode(), "", 0.0, 1)  # code is 422
    assert checked(wire) == ["error body"]
    wire.reply = Outcome(200, b"data: {}\n\n", "text/event-stream", 0.0, 1)
    assert checked(wire) == ["stream"]  # no [DONE]
    wire.reply = Outcome(0, b"", "", 0.0, None, "RemoteProtocolError")
    assert checked(wire) == ["connection"]


def test_every_way_of_losing_a_write_is_counted() -> None:
    final = {"s": [9, 1, 1, 9, 2, 2, 9]}
    writes = [Write("s", 1, 2, (1, 1), False), Write("s", 2, 3, (2, 2), False)]
    assert _verdict(writes, final)["lost_updates"] == 0
    gone = [*writes, Write("s", 3, 4, (3, 3), False)]
    assert _verdict(gone, final)["missing_markers"] == 1
    twice = [Write("s", 1, 2, (1, 1), False), Write("s", 1, 3, (2, 2), False)]
    assert _verdict(twice, final)["two_writes_one_revision"] == 1
    stale = [Write("s", 1, 2, (1, 1), True)]
    assert _verdict(stale, final)["lost_updates"] == 1
    backwards = [Write("s", 1, 3, (1, 1), False), Write("s", 2, 2, (2, 2), False)]
    assert _verdict(backwards, final)["out_of_order"] == 1


class Counting(RandomSource):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.draws: list[tuple[int, int]] = []

    def integer(self, low: int, high: int) -> int:
        self.draws.append((low, high))
        return super().integer(low, high)


def test_the_fuzzer_draws_the_same_whatever_the_sessions_hold() -> None:
    # Hypothesis (tests/server/test_fuzz.py) needs the same draws for the same choices.
    small = {"session": "fz-0", "revision": 1, "num_tokens": 3, "tokens": [1, 2, 3], "spans": []}
    big = small | {"revision": 90, "num_tokens": 300, "tokens": list(range(300)),
                   "spans": [{"message": i} for i in range(4)]}  # fmt: skip
    for seed in range(20):
        runs = []
        for view in (small, big, None):
            source = Counting(seed)
            fuzzer = Fuzzer(source, LIMITS)
            for _ in range(30):
                fuzzer.next({"fz-0": view, "fz-1": view, "fz-new": None, "fz ü": None})
            runs.append(source.draws)
        assert runs[0] == runs[1] == runs[2]


@pytest.mark.slow
@pytest.mark.model
def test_fast_run_on_the_embedded_server(tmp_path: Path) -> None:
    from leyline.evals.robustness.run import Options, run_robustness

    options = Options(mode="fast", out=tmp_path, progress=False, **SIZES["fast"])
    data = run_robustness(options)
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert on_disk["targets"] == data["targets"]
    markdown = (tmp_path / "report.md").read_text()
    for heading in ("Targets", "Fuzz: statuses", "Lost updates", "Redaction", "Cross-tenant"):
        assert heading in markdown
    fuzz = data["fuzz"]
    assert fuzz["requests"] == SIZES["fast"]["requests"]
    assert sum(fuzz["statuses"].values()) == fuzz["requests"]
    assert {"200", "422"} <= set(fuzz["statuses"])  # both accepted and rejected requests
    races = data["lost_updates"]
    assert races["accepted_writes"] > 0 and any(k.startswith("stale 409") for k in races["answers"])
    controls = [r for r in data["redaction"] if r["scenario"].startswith("control")]
    assert controls and all(r["leaked_tokens"] > 0 for r in controls)  # a leak would show
    tenant_a = [r for r in data["cross_tenant"] if r["how"].startswith("control")]
    assert tenant_a and all(r["reused"] > 0 for r in tenant_a)  # the cache works within A
    assert data["health"]["busy_ms"]["samples"] > 0  # its p99 depends on the machine's load
    assert counts(data) == dict.fromkeys(counts(data), 0), fuzz["examples"]
