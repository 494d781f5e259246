"""The targets table, ``report.md`` and the text printed at the end of a run."""

from __future__ import annotations

from typing import Any

from leyline.evals.common import Report, markdown_table

HEALTH_P99_MS = 100.0
FULL = {"requests": 10_000, "clients": 16, "turns": 60}
"""The issue's sizes; a smaller run reports the same zero targets at its own size."""


def counts(data: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers, each of which must be 0 (health: under its bound)."""
    fuzz, races = data["fuzz"], data["lost_updates"]
    v = fuzz["violations"]
    return {
        "5xx": v["5xx"],
        "state changes on rejection": v["state change"] + v["created"],
        "error bodies not the protocol's": v["error body"],
        "dropped connections": v["connection"],
        "broken successes (stream, JSON)": v["stream"],
        "lost updates": races["lost_updates"],
        "redaction leaks": sum(
            r["leaked_tokens"] > 0
            for r in data["redaction"]
            if not r["scenario"].startswith("control")
        ),
        "cross-tenant reuse": sum(
            r["reused"] > 0 for r in data["cross_tenant"] if not r["how"].startswith("control")
        ),
    }


def targets(data: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    rows = [
        {"check": name, "value": value, "target": "0", "met": value == 0}
        for name, value in counts(data).items()
    ]
    p99 = data["health"]["busy_ms"]["p99"]
    rows.append(
        {
            "check": "/health p99 while rendering (ms)",
            "value": p99,
            "target": f"< {HEALTH_P99_MS:g}",
            "met": p99 is not None and p99 < HEALTH_P99_MS,
        }
    )
    fuzz, races = data["fuzz"], data["lost_updates"]
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


def fill(report: Report, data: dict[str, Any]) -> None:
    rows = [
        [t["check"], t["value"], t["target"], "yes" if t["met"] else "NO"] for t in data["targets"]
    ]
    note = f"Internal errors in the server log: {data['internal_errors_logged']}."
    report.section(
        "Targets", markdown_table(["check", "value", "target", "met"], rows) + f"\n\n{note}"
    )
    _fuzz(report, data["fuzz"])
    _races(report, data["lost_updates"])
    _leaks(report, data["redaction"], data["cross_tenant"])
    _health(report, data["health"])


def _fuzz(report: Report, fuzz: dict[str, Any]) -> None:
    head = (
        f"{fuzz['requests']} requests in {fuzz['seconds']:.0f} s ({fuzz['requests_per_s']:.1f}/s), "
        f"plus {fuzz['setup_requests']} state reads and resets."
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


def _leaks(report: Report, redaction: list[dict[str, Any]], crossed: list[dict[str, Any]]) -> None:
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
    rows = [[r["trial"], r["how"], r["reused"]] for r in crossed]
    table = markdown_table(["trial", "tenant B sends A's prompt", "reused tokens"], rows)
    report.section("Cross-tenant reuse", table)


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
    lines = [
        f"fuzz: {fuzz['requests']} requests in {fuzz['seconds']:.0f} s; statuses "
        + ", ".join(f"{k}: {n}" for k, n in fuzz["statuses"].items())
    ]
    for t in data["targets"]:
        verdict = "ok" if t["met"] else "NOT MET"
        lines.append(f"  {t['check']:<40} {t['value']!s:>14}  target {t['target']:<12} {verdict}")
    for e in fuzz["examples"][:10]:
        lines.append(
            f"  ! {e['kind']} ({e['status']}) x{e['times']}: {e['detail'][:120]}\n"
            f"      {e['request'][:200]}"
        )
    return "\n".join(lines)
