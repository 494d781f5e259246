"""`leyline eval robustness`: its checks catch what they claim to, and a --fast run on the
embedded server reports zero failures of every kind."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from leyline.evals.robustness.checks import Checker
from leyline.evals.robustness.cli import SIZES
from leyline.evals.robustness.fuzz import Call, Fuzzer, Limits, enveloped
from leyline.evals.robustness.isolation import TOLERANCE, compare, keyed, leaks, parse_answer
from leyline.evals.robustness.races import Write, _verdict
from leyline.evals.robustness.report import counts, met, targets, vacuous_controls
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


EXACT = {" a": -0.5, " b": -1.5, " c": -2.5, " d": -6.0}


def test_the_comparison_flags_a_wrong_distribution() -> None:
    same = {k: v + 2e-4 for k, v in EXACT.items()}
    assert compare(EXACT, same)["max_abs_delta"] == pytest.approx(2e-4)
    shifted = EXACT | {" a": -0.9, " b": -1.1}  # what KV that saw the removed span gives
    assert compare(EXACT, shifted)["max_abs_delta"] == pytest.approx(0.4)
    # a top token the server does not list: its logprob there is at most the server's
    # smallest, so the delta is at least exact - smallest
    dropped = {" b": -1.5, " c": -2.5, " d": -6.0, " e": -7.0}
    got = compare(EXACT, dropped)
    assert got["missing"] == 1 and got["max_abs_delta"] == pytest.approx(6.5)
    # a token the server ranks high that the exact top lacks
    intruder = EXACT | {" z": -1.0}
    assert compare(EXACT, intruder)["max_abs_delta"] == pytest.approx(5.0)
    assert compare(EXACT, {})["max_abs_delta"] == float("inf")
    # two reference ids with one text are ambiguous: left out, never matched to either
    texts = {1: " a", 2: " b", 3: " b", 4: " c"}
    assert keyed([(1, -0.5), (2, -1.0), (3, -1.2), (4, -2.0)], texts.__getitem__) == {
        " a": -0.5,
        " c": -2.0,
    }
    answer = parse_answer(
        {"choices": [{"logprobs": {"top_logprobs": [same]}}],
         "usage": {"prompt_tokens_details": {"cached_tokens": 7}}}
    )  # fmt: skip
    assert answer.top == same and answer.reused == 7 and answer.leyline is None


def test_a_cross_session_leak_fails_its_target_and_na_is_no_pass() -> None:
    def arm(delta: float, **extra: Any) -> dict[str, Any]:
        return {"max_abs_delta": delta, "compared": 20, "missing": 0, **extra}

    good = {
        "scenario": 0, "splice": {"path": "splice", **arm(0.9), "definition": arm(3e-5)},
        "plain": arm(1e-5, reused=16, reused_past_edit=0), "forget": arm(2e-5),
        "erratum": arm(1e-5),
    }  # fmt: skip
    assert leaks(good) == []
    wrong = good | {"plain": arm(0.3, reused=48, reused_past_edit=20)}
    assert len(leaks(wrong)) == 2  # the delta and the reuse past the edit
    assert leaks(good | {"forget": arm(TOLERANCE * 1.5)}) != []
    assert leaks(good | {"erratum": arm(0.2)}) != []
    # A splice off its own definition (say, unrotated) fails; none computed is no verdict.
    assert leaks(good | {"splice": good["splice"] | {"definition": arm(0.4)}}) != []
    assert leaks(good | {"splice": good["splice"] | {"definition": None}}) == []
    na = {"n/a": "not asked for"}
    data: dict[str, Any] = dict.fromkeys(
        ("fuzz", "lost_updates", "redaction", "cross_tenant", "health"), na
    )
    data["cross_salt"] = [{"trial": 0, "how": "session, salt Y", "reused": 0, "probe": True}]
    data["cross_session"] = [good | {"leaks": leaks(good)}]
    rows = {t["check"]: t for t in targets(data, "fast")}
    assert rows["cross-tenant reuse"]["met"] is None  # n/a is neither met nor failed
    assert rows["cross-session leaks (plain, forget, erratum, splice def.)"]["met"] is True
    assert met({"targets": list(rows.values())})
    data["cross_session"] = [wrong | {"leaks": leaks(wrong)}]
    assert counts(data)["cross-session leaks (plain, forget, erratum, splice def.)"] == 1
    assert not met({"targets": targets(data, "fast")})
    data["cross_session"] = [good | {"splice": arm(0.9, path="reprefill"), "leaks": []}]
    assert counts(data)["cross-session splices not run as splice"] == 1
    # A splice that declares a fallback (protocol 6) is reported, not compared or failed.
    declared = {"path": "splice", "fallback": "page_alignment", **arm(0.9), "definition": None}
    data["cross_session"] = [good | {"splice": declared, "leaks": []}, good | {"leaks": []}]
    rows = {t["check"]: t for t in targets(data, "fast")}
    fell_back = rows["cross-session splices with a declared fallback"]
    assert fell_back["value"] == "1 of 2 (page_alignment)" and fell_back["met"] is None
    assert met({"targets": list(rows.values())})


def test_a_control_that_reused_nothing_fails_the_run() -> None:
    """A probe that reused nothing shows no leak only if its control reused something."""
    name = "controls that reused nothing (probes that could not fail)"
    na = {"n/a": "not asked for"}
    data: dict[str, Any] = dict.fromkeys(("fuzz", "lost_updates", "health"), na)
    data["redaction"] = [
        {"scenario": "forgotten", "probe_reused": 0, "secret_start": 40},
        {"scenario": "control: no forget", "probe_reused": 128, "secret_start": 40},
    ]
    data["cross_tenant"] = [
        {"how": "stateless", "reused": 0},
        {"how": "control: tenant A again", "reused": 128},
    ]
    data["cross_salt"] = [
        {"how": "session, salt Y", "reused": 0, "probe": True},
        {"how": "control: salt X again", "reused": 256, "probe": False},
    ]
    for row in data["redaction"]:
        row["leaked_tokens"] = max(0, row["probe_reused"] - row["secret_start"])
    assert counts(data)[name] == 0
    # Whole blocks longer than the prompts: nothing reused anywhere, controls included.
    data["redaction"][1]["probe_reused"] = 0
    data["cross_tenant"][1]["reused"] = 0
    assert vacuous_controls(data) == 2
    assert not met({"targets": targets(data, "fast")})
    assert vacuous_controls(dict.fromkeys(("redaction", "cross_tenant", "cross_salt"), na)) == (
        "n/a: no reuse probe ran"
    )


class Counting(RandomSource):
    def __init__(self, seed: int) -> None:
        super().__init__(seed)
        self.draws: list[tuple[int, int]] = []

    def integer(self, low: int, high: int) -> int:
        self.draws.append((low, high))
        return super().integer(low, high)


def test_the_fuzzer_draws_the_same_whatever_the_sessions_hold() -> None:
    # Hypothesis (tests/serve/test_fuzz.py) needs the same draws for the same choices.
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
    for heading in ("Targets", "Fuzz: statuses", "Lost updates", "Redaction", "Cross-tenant",
                    "Cross-session", "Cross-salt"):  # fmt: skip
        assert heading in markdown
    assert len(data["cross_session"]) == SIZES["fast"]["scenarios"]
    checked = [t for t in data["targets"] if t["target"] != "reported"]
    assert all(t["met"] is not None for t in checked)  # nothing is n/a here
    (fallbacks,) = [t for t in data["targets"] if t["target"] == "reported"]
    assert fallbacks["value"].startswith("0 of ")  # the reference never falls back
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


@pytest.mark.slow
@pytest.mark.model
def test_isolation_checks_against_a_live_leyline_serve(tmp_path: Path) -> None:
    """--base-url on a real `leyline serve` (two tenants): cross-session against the
    transformers reference, cross-salt, cross-tenant; the rest asked away is n/a."""
    from leyline.evals.robustness.run import Options, run_robustness
    from leyline.evals.robustness.server import ServerLimits, serve
    from leyline.sglang.live_models import smollm2_dir

    model_dir = smollm2_dir()
    with serve(tmp_path, ServerLimits()) as served:
        options = Options(
            mode="fast", out=tmp_path / "report", progress=False, base_url=served.base_url,
            api_key=served.keys["alpha"], api_key_b=served.keys["bravo"], model_dir=model_dir,
            checks=("cross_session", "cross_salt", "cross_tenant"), scenarios=1, trials=1,
            prompt_tokens=60,
        )  # fmt: skip
        data = run_robustness(options)
    rows = {t["check"]: t for t in data["targets"]}
    assert rows["5xx"]["met"] is None and str(rows["5xx"]["value"]).startswith("n/a")
    for check in ("cross-tenant reuse", "cross-session leaks (plain, forget, erratum, splice def.)",
                  "cross-session splices not run as splice", "cross-salt reuse"):  # fmt: skip
        assert rows[check]["met"] is True, rows[check]
    (scenario,) = data["cross_session"]
    assert scenario["reference"].startswith("transformers")
    assert scenario["exact_top"] >= 15
    for arm in ("plain", "forget"):
        assert scenario[arm]["max_abs_delta"] <= TOLERANCE, scenario
    assert scenario["forget"]["path"] == "reprefill"
    # the splice keeps KV that attended to the removed span: its own turn differs
    assert scenario["splice"]["max_abs_delta"] > TOLERANCE, scenario
    controls = [r for r in data["cross_salt"] if r["how"].startswith("control")]
    assert controls and all(r["reused"] > 0 for r in controls)  # a zero means something


def test_a_pin_that_lapsed_meanwhile_is_no_state_change() -> None:
    """A rejected request must leave the session as it was; a pin whose ttl_s ran out in
    the meantime is dropped by the server itself, so it is no violation. Anything else is."""
    from leyline.evals.robustness.checks import same_state

    pin = {"verb": "pin", "start": 0, "end": 4, "expires_at": 100.0}
    before = {"revision": 3, "num_tokens": 9, "tokens": None, "spans": [], "marks": [pin]}
    lapsed = before | {"marks": []}
    assert same_state(before, lapsed, now=100.5)  # it ran out: the server dropped it
    assert not same_state(before, lapsed, now=99.0)  # still live: dropping it is a change
    assert not same_state(before, before | {"revision": 4}, now=100.5)
    held = before | {"marks": [pin | {"expires_at": None}]}
    assert not same_state(held, held | {"marks": []}, now=1e12)  # no ttl: never lapses


def test_the_fuzzer_carries_leyline_requests_in_envelopes_and_nothing_else() -> None:
    body = b'{"base_revision": 1, "directives": []}'
    direct = Call("POST", "/leyline/v1/sessions/fz-0/directives", "r", body, "fz-0", label="x")
    carried = enveloped(direct)
    assert carried is not None and carried.path == "/v1/completions"
    assert (carried.session, carried.route, carried.label) == ("fz-0", "r", "x, enveloped")
    route = json.loads(carried.body or b"")["leyline"]["route"]
    assert route == {"method": "POST", "path": direct.path, "body": json.loads(body)}
    plain_chat = Call("POST", "/v1/chat/completions", "c", b'{"messages": []}')
    assert enveloped(plain_chat) is None  # the host's request: its errors are the host's
    assert enveloped(replace(direct, body=b"{not json")) is None
    assert enveloped(replace(direct, method="PATCH")) is None
