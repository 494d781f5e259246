"""The targets table, ``report.md`` and the text printed at the end of a run."""

from __future__ import annotations

from typing import Any

from leyline.evals.common import Report, markdown_table

from .isolation import TOLERANCE, TOP

HEALTH_P99_MS = 100.0
FULL = {"requests": 10_000, "clients": 16, "turns": 60}
"""The issue's sizes; a smaller run reports the same zero targets at its own size."""


def na(phase: Any) -> str | None:
    """Why a check did not run on this server (``{"n/a": why}``), or None when it ran."""
    return f"n/a: {phase['n/a']}" if isinstance(phase, dict) and "n/a" in phase else None


def counts(data: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, each of which must be 0; a check that did not run on this
    server gives its ``n/a: why`` instead (never a pass)."""
    fuzz, races = data["fuzz"], data["lost_updates"]
    out: dict[str, Any] = {}
    fuzz_na = na(fuzz)
    v = fuzz["violations"] if fuzz_na is None else {}
    for name, kinds in (
        ("5xx", ("5xx",)),
        ("state changes on rejection", ("state change", "created")),
        ("error bodies not the protocol's", ("error body",)),
        ("dropped connections", ("connection",)),
        ("broken successes (stream, JSON)", ("stream",)),
    ):
        out[name] = fuzz_na or sum(v[k] for k in kinds)
    out["lost updates"] = na(races) or races["lost_updates"]
    out["redaction leaks"] = na(data["redaction"]) or sum(
        r["leaked_tokens"] > 0 for r in data["redaction"] if not r["scenario"].startswith("control")
    )
    out["cross-tenant reuse"] = na(data["cross_tenant"]) or sum(
        r["reused"] > r.get("allowed", 0)
        for r in data["cross_tenant"]
        if not r["how"].startswith("control")
    )
    crossed = data.get("cross_session", {"n/a": "not run"})
    out["cross-session leaks (plain, forget, erratum, splice def.)"] = na(crossed) or sum(
        bool(r["leaks"]) for r in crossed
    )
    out["cross-session splices not run as splice"] = na(crossed) or sum(
        r["splice"]["path"] != "splice" for r in crossed
    )
    salted = data.get("cross_salt", {"n/a": "not run"})
    out["cross-salt reuse"] = na(salted) or sum(bool(r["reused"]) for r in salted if r["probe"])
    out["controls that reused nothing (probes that could not fail)"] = vacuous_controls(data)
    return out


def vacuous_controls(data: dict[str, Any]) -> int | str:
    """Controls of the reuse probes that found nothing to reuse: a server that caches only
    whole blocks longer than the probes' prompts would pass every probe without showing
    anything. Each control repeats what its probes send, where reuse is allowed."""
    names = ("redaction", "cross_tenant", "cross_salt")
    ran = {k: data[k] for k in names if na(data.get(k, {"n/a": "not run"})) is None}
    if not ran:
        return "n/a: no reuse probe ran"
    missed = sum(
        r["probe_reused"] <= r["secret_start"]
        for r in ran.get("redaction", [])
        if r["scenario"].startswith("control")
    )
    for phase in ("cross_tenant", "cross_salt"):
        missed += sum(not r["reused"] for r in ran.get(phase, []) if r["how"].startswith("control"))
    return missed


def targets(data: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """One row per check: ``met`` is True, False, or None where the check is n/a."""
    rows = [
        {
            "check": name,
            "value": value,
            "target": "0",
            "met": None if isinstance(value, str) else value == 0,
        }
        for name, value in counts(data).items()
    ]
    crossed = data.get("cross_session", {"n/a": "not run"})
    if na(crossed) is None:
        # Protocol 6 lets a splice fall back if it says why; how often it did is reported.
        reasons = sorted({str(r["splice"].get("fallback")) for r in crossed} - {"None"})
        fell_back = sum(r["splice"].get("fallback") is not None for r in crossed)
        rows.append(
            {
                "check": "cross-session splices with a declared fallback",
                "value": f"{fell_back} of {len(crossed)}"
                + (f" ({', '.join(reasons)})" * bool(reasons)),
                "target": "reported",
                "met": None,
            }
        )
    health = data["health"]
    p99 = None if na(health) else health["busy_ms"]["p99"]
    rows.append(
        {
            "check": "/health p99 while rendering (ms)",
            "value": na(health) or p99,
            "target": f"< {HEALTH_P99_MS:g}",
            "met": None if na(health) else p99 is not None and p99 < HEALTH_P99_MS,
        }
    )
    fuzz, races = data["fuzz"], data["lost_updates"]
    if na(fuzz) is None and na(races) is None:
        size_met = (
            fuzz["requests"] >= FULL["requests"]
            and races["clients"] >= FULL["clients"]
            and races["turns"] >= FULL["turns"]
        )
        rows.append(
            {
                "check": "size (requests; clients x turns)",
                "value": f"{fuzz['requests']}; {races['clients']} x {races['turns']}",
                "target": f">= {FULL['requests']}; {FULL['clients']} x {FULL['turns']} (--full)",
                "met": size_met,
            }
        )
    return rows


def met(data: dict[str, Any]) -> bool:
    """Every target that ran is met (sizes aside); an n/a one is neither met nor failed."""
    return all(t["met"] is not False for t in data["targets"] if not t["check"].startswith("size"))


def fill(report: Report, data: dict[str, Any]) -> None:
    rows = [
        [t["check"], t["value"], t["target"], _verdict(t["met"], "yes", "NO")]
        for t in data["targets"]
    ]
    internal = data["internal_errors_logged"]
    note = (
        f"Internal errors in the server log: {internal}."
        if internal is not None
        else "No server log here (--base-url): internal errors are not counted."
    )
    server = data.get("server")
    head = f"Server: {server}.\n\n" if server else ""
    table = markdown_table(["check", "value", "target", "met"], rows)
    report.section("Targets", f"{head}{table}\n\n{note}")
    for title, phase, show in (
        ("Fuzz: statuses", data["fuzz"], _fuzz),
        ("Lost updates", data["lost_updates"], _races),
        ("Redaction after FORGET", data["redaction"], _redaction),
        ("Cross-tenant reuse", data["cross_tenant"], _cross_tenant),
        ("Cross-session reuse of non-prefill KV", data["cross_session"], _cross_session),
        ("Cross-salt reuse", data["cross_salt"], _cross_salt),
        ("/health while a long chat renders", data["health"], _health),
    ):
        if na(phase):
            report.section(title, na(phase) or "")
        else:
            show(report, phase)


def _fuzz(report: Report, fuzz: dict[str, Any]) -> None:
    head = (
        f"{fuzz['requests']} requests in {fuzz['seconds']:.0f} s ({fuzz['requests_per_s']:.1f}/s), "
        f"plus {fuzz['setup_requests']} state reads and resets."
    )
    if fuzz.get("host_answers"):
        head += (
            f" {fuzz['host_answers']} failures were answered by the host server's own routes"
            " (not Leyline's requests): their bodies are not checked."
        )
    statuses = markdown_table(["status", "requests"], list(fuzz["statuses"].items()))
    codes = markdown_table(["error code", "requests"], list(fuzz["codes"].items()))
    report.section("Fuzz: statuses", f"{head}\n\n{statuses}\n\n{codes}")
    columns = sorted({s for c in fuzz["by_route"].values() for s in c}, key=int)
    routes = sorted(fuzz["by_route"].items())
    rows = [[route, *(c.get(s, 0) for s in columns)] for route, c in routes]
    report.section("Fuzz: statuses by route", markdown_table(["route", *columns], rows))
    if fuzz["examples"]:
        rows = [
            [
                e["kind"],
                e["status"],
                e["times"],
                _cell(e["detail"][:160]),
                _cell(e["request"][:240]),
            ]
            for e in fuzz["examples"]
        ]
        table = markdown_table(["kind", "status", "times", "detail", "first request"], rows)
        report.section("Fuzz: violations (one per distinct problem)", table)


def _races(report: Report, races: dict[str, Any]) -> None:
    names = {
        "accepted_writes": "accepted writes",
        "lost_updates": "lost",
        "missing_markers": "missing markers",
        "two_writes_one_revision": "two writes, one revision",
        "stale_writes_accepted": "stale accepted",
        "out_of_order": "out of order",
    }
    head = (
        f"{races['clients']} clients x {races['turns']} turns on {races['sessions']} shared "
        "sessions; every 5th turn addresses the revision before (stale)."
    )
    table = markdown_table(list(names.values()), [[races[k] for k in names]])
    answers = markdown_table(["answer", "count"], list(races["answers"].items()))
    report.section("Lost updates", f"{head}\n\n{table}\n\n{answers}")


def _redaction(report: Report, redaction: list[dict[str, Any]]) -> None:
    header = ["scenario", "trial", "secret [start, end)", "probe reused", "leaked tokens"]
    rows = [
        [r["scenario"], r["trial"], _span(r), r["probe_reused"], r["leaked_tokens"]]
        for r in redaction
    ]
    note = (
        "The control forgets nothing: its probe reuses past the secret's start, so a leak "
        "would show. It is not counted as a leak."
    )
    report.section("Redaction after FORGET", markdown_table(header, rows) + f"\n\n{note}")


def _cross_tenant(report: Report, crossed: list[dict[str, Any]]) -> None:
    rows = [[r["trial"], r["how"], r["reused"], r.get("allowed", "-")] for r in crossed]
    header = ["trial", "tenant B sends A's prompt", "reused tokens", "allowed (chat header)"]
    report.section("Cross-tenant reuse", markdown_table(header, rows))


def _cross_session(report: Report, rows: list[dict[str, Any]]) -> None:
    header = [
        "scenario", "tokens", "span", "splice path", "splice arm |Δ| (vs its definition)",
        "plain |Δ|", "plain reused", "forget |Δ|", "forget path", "forget reused",
        "erratum |Δ|",
    ]  # fmt: skip
    table = [
        [
            r["scenario"],
            r["tokens"],
            f"[{r['span'][0]}, {r['span'][1]})",
            r["splice"]["path"],
            f"{_delta(r['splice'])} ({_definition(r)})",
            _delta(r["plain"]),
            _reuse(r["plain"]["reused"]),
            _delta(r["forget"]),
            r["forget"]["path"],
            _reuse(r["forget"]["reused"]),
            _delta(r["erratum"]) if "erratum" in r else "-",
        ]
        for r in rows
    ]
    references = ", ".join(sorted({r["reference"] for r in rows}))
    note = (
        f"|Δ|: max |Δ logprob| over the exact next-token top-{TOP} of the edited tokens "
        f"(reference: {references}); target <= {TOLERANCE:g} for the plain request, the "
        "FORGET and the erratum. The splice arm is P's own turn: it keeps KV that attended "
        "to the removed span, so it differs from the exact prefill (informative); in "
        "brackets, against the splice's own definition computed with transformers (target "
        f"<= {TOLERANCE:g}; `-` without --model-dir). Reused: the server's count of cached "
        "prompt tokens (`-`: not reported); the plain request may reuse at most the tokens "
        "before the stub's end."
    )
    if any("server prefill" in r["reference"] for r in rows):
        note += (
            " Without --model-dir the reference is the same server's prefill: a server "
            "wrong in both would pass."
        )
    bad = [f"scenario {r['scenario']}: {'; '.join(r['leaks'])}" for r in rows if r["leaks"]]
    tail = ("\n\n" + "\n".join(f"* {b}" for b in bad)) if bad else ""
    report.section(
        "Cross-session reuse of non-prefill KV",
        markdown_table(header, table) + f"\n\n{note}{tail}",
    )


def _cross_salt(report: Report, rows: list[dict[str, Any]]) -> None:
    table = [[r["trial"], r["how"], r["salt"] or "-", _reuse(r["reused"])] for r in rows]
    note = (
        "Probes (salt Y, no salt, plain) must reuse 0 tokens; the control (salt X again) "
        "reuses, so a zero means something. Every prompt starts with random token ids."
    )
    body = markdown_table(["trial", "request", "cache_salt", "reused tokens"], table)
    report.section("Cross-salt reuse", f"{body}\n\n{note}")


def _definition(row: dict[str, Any]) -> str:
    definition = row["splice"].get("definition")
    return "-" if definition is None else _delta(definition)


def _delta(arm: dict[str, Any] | None) -> str:
    delta = None if arm is None else arm["max_abs_delta"]
    if delta is None:
        return "-"
    missing = f" ({arm['missing']} missing)" if arm and arm.get("missing") else ""
    return f"{delta:.2e}{missing}"


def _reuse(value: int | None) -> str:
    return "-" if value is None else str(value)


def _verdict(met: bool | None, yes: str, no: str) -> str:
    return "n/a" if met is None else yes if met else no


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _span(row: dict[str, Any]) -> str:
    return f"[{row['secret_start']}, {row['secret_end']})"


def _health(report: Report, health: dict[str, Any]) -> None:
    when = (("idle", health["idle_ms"]), ("rendering", health["busy_ms"]))
    rows = [[name, h["samples"], h["p50"], h["p99"], h["max"]] for name, h in when]
    table = markdown_table(["when", "samples", "p50 ms", "p99 ms", "max ms"], rows)
    answers = ", ".join(
        f"{r['status']} {r['code'] or ''} in {r['seconds']:.2f} s" for r in health["renders"]
    )
    body = f"{table}\n\nThe long chat: {health['messages']} messages; answers: {answers}."
    report.section("/health while a long chat renders", body)


def text(data: dict[str, Any]) -> str:
    fuzz = data["fuzz"]
    lines = []
    if not na(fuzz):
        lines.append(
            f"fuzz: {fuzz['requests']} requests in {fuzz['seconds']:.0f} s; statuses "
            + ", ".join(f"{k}: {n}" for k, n in fuzz["statuses"].items())
        )
        if fuzz.get("host_answers"):
            lines.append(
                f"  ({fuzz['host_answers']} failures answered by the host server's own "
                "routes: their bodies are not checked)"
            )
    for t in data["targets"]:
        verdict = _verdict(t["met"], "ok", "NOT MET")
        lines.append(f"  {t['check']:<44} {t['value']!s:>14}  target {t['target']:<12} {verdict}")
    crossed = data.get("cross_session")
    if crossed and not na(crossed):
        for r in crossed:
            lines.append(
                f"  cross-session {r['scenario']}: max |Δ logprob| plain {_delta(r['plain'])}, "
                f"forget {_delta(r['forget'])}, erratum {_delta(r.get('erratum'))}, splice arm "
                f"{_delta(r['splice'])} (vs its definition {_definition(r)}); reused plain "
                f"{_reuse(r['plain']['reused'])}, forget {_reuse(r['forget']['reused'])} "
                f"of {r['edited_tokens']}"
            )
    for e in [] if na(fuzz) else fuzz["examples"][:10]:
        lines.append(
            f"  ! {e['kind']} ({e['status']}) x{e['times']}: {e['detail'][:120]}\n"
            f"      {e['request'][:200]}"
        )
    return "\n".join(lines)
