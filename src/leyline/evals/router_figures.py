"""What ``make router-live-check`` counts and how it judges it (``router_check`` runs the
processes and the episodes): pure functions of the SDK's call records and the answers the
driver's client saw, tested without a router or a model (tests/evals/test_router_check.py).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ROUTER_VERSION = "0.3.2"
CHAT_ROUTE = "/v1/chat/completions"
SESSION_ROUTES = "/leyline/v1/sessions/"
RECREATED = "session_lost"
SPLICE = "splice"

SPLICE_SHARE_POINTS = 5.0
"""Target: pass 2's splice share (re-creation calls left out) within this many percentage
points of pass 1's."""
OVERHEAD_MS = 5.0
"""Target: the router's added latency, p50, at most this."""


@dataclass(frozen=True, slots=True)
class Exchange:
    """One HTTP answer the driver's OpenAI client got."""

    t: float
    """When it answered, seconds since the run started."""
    key: str | None
    """The request's routing key (its session), None without one."""
    route: str
    """The route the request was for: an envelope's inner path, else the URL's path."""
    status: int
    worker: str | None
    """Which worker answered (``X-Leyline-Worker``, ``#2`` after a restart); None where the
    router answered itself (a 500 or 503 while a worker was out of reach)."""
    pass_name: str = ""

    @property
    def stateful(self) -> bool:
        """The request reads or changes its session on the worker (a chat turn, a session's
        GET or DELETE). A tokenize carries the session's key too, but any worker can answer
        it alike, so it says nothing about where the session lives."""
        return self.route == CHAT_ROUTE or self.route.startswith(SESSION_ROUTES)


@dataclass
class Episode:
    """One agent episode of one pass, as the driver saw it."""

    index: int
    trajectory: str
    turns: int
    """Turns planned."""
    answered: int = 0
    """Turns whose ``create`` returned."""
    error: str | None = None
    """What a ``create`` raised (the episode stopped there)."""
    agent_messages: list[list[Any]] = field(default_factory=list)
    """The key of each message the agent had when it last called (see :func:`message_key`)."""
    sent_messages: list[list[Any]] | None = None
    """The keys of the messages of the last chat request a worker answered (2xx) in the
    episode's final session; None if none was captured."""
    records: list[dict[str, Any]] = field(default_factory=list)
    """The SDK's ``CallRecord.to_json()`` of each call, with ``answered_s`` (seconds since
    the run started)."""
    sessions: list[str] = field(default_factory=list)
    """The episode's session ids in order (a re-created one follows the one lost)."""

    @property
    def completed(self) -> bool:
        return self.error is None and self.answered == self.turns

    def lost_by_count(self) -> int:
        """Agent messages the last answered call did not carry (its record's count); an
        episode with no answered call lost all of them."""
        sent = self.records[-1]["messages"] if self.records else 0
        return max(0, len(self.agent_messages) - int(sent))

    def lost_by_key(self) -> int:
        """Agent messages missing, by key, from the last request a worker answered: a
        message the policy edited (a truncated tool output) counts as present."""
        sent = Counter(map(_hashable, self.sent_messages or []))
        wanted = Counter(map(_hashable, self.agent_messages))
        return sum((wanted - sent).values())

    def lost(self) -> int:
        return max(self.lost_by_count(), self.lost_by_key())


def message_key(message: Mapping[str, Any]) -> list[Any]:
    """What names a message whatever a policy did to its content: a tool output by its call
    id, an assistant's tool calls by theirs, any other message by its role and content."""
    role = message.get("role")
    if role == "tool":
        return [role, message.get("tool_call_id")]
    calls = message.get("tool_calls")
    if calls:
        return [role, [c.get("id") for c in calls]]
    content = message.get("content")
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return [role, text]


def _hashable(key: Sequence[Any]) -> str:
    return json.dumps(key)


def stickiness(exchanges: Iterable[Exchange]) -> dict[str, set[str]]:
    """Each session's workers: those that answered one of its stateful requests with a 2xx
    (a lost session's 404 from another worker is not a 2xx). A restarted worker counts as
    another one (``A#2``): its sessions are gone."""
    workers: dict[str, set[str]] = {}
    for e in exchanges:
        if e.key is None or not e.stateful:
            continue
        seen = workers.setdefault(e.key, set())
        if 200 <= e.status < 300 and e.worker is not None:
            seen.add(e.worker)
    return workers


@dataclass(frozen=True, slots=True)
class Share:
    splices: int
    calls: int

    @property
    def percent(self) -> float | None:
        return None if self.calls == 0 else 100.0 * self.splices / self.calls

    def text(self) -> str:
        p = self.percent
        return "-" if p is None else f"{p:.1f}% ({self.splices}/{self.calls})"


def splice_share(
    records: Iterable[Mapping[str, Any]],
    *,
    since: float | None = None,
    until: float | None = None,
    recreations: bool = True,
) -> Share:
    """The share of calls the server ran as a splice, of those answered in ``[since,
    until)``; ``recreations=False`` leaves out the calls that re-created a lost session
    (prefilled by design)."""

    def inside(t: float | None) -> bool:
        if since is None and until is None:
            return True
        return t is not None and (since is None or t >= since) and (until is None or t < until)

    chosen = [
        r
        for r in records
        if inside(r.get("answered_s")) and (recreations or r.get("resync") != RECREATED)
    ]
    return Share(sum(r.get("path") == SPLICE for r in chosen), len(chosen))


def recreations(episodes: Iterable[Episode]) -> list[dict[str, Any]]:
    """The records of the calls that re-created a lost session."""
    return [r for e in episodes for r in e.records if r.get("resync") == RECREATED]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linear between the closest ranks."""
    if not values:
        raise ValueError("no values")
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low, high = math.floor(position), math.ceil(position)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class Fault:
    """What happened to the worker killed in pass 2 (seconds since the run started)."""

    worker: str
    live: dict[str, list[str]]
    """Each worker's live sessions when the kill was decided."""
    at_turns: int
    t_kill: float
    t_unhealthy: float | None
    """When the router's ``GET /workers`` first showed it unhealthy."""
    t_restart: float
    t_up: float
    """When its ``/health`` answered again."""
    t_back: float
    """When the router showed it healthy again."""


@dataclass(frozen=True, slots=True)
class Target:
    name: str
    value: str
    goal: str
    ok: bool


@dataclass(frozen=True, slots=True)
class Figures:
    """What the targets are judged on."""

    episodes: int
    completed: int
    lost_messages: int
    sessions: int
    sticky: int
    share_pass1: float | None
    share_pass2: float | None
    """Pass 2's whole splice share, the re-creation calls left out."""
    overhead_ms: float | None
    killed: bool
    called_again: int
    """Sessions of the killed worker (live when it was killed) that made a call after."""
    unrecreated: int
    """Sessions of the killed worker that made a call after the kill and were not
    re-created."""


def targets(f: Figures) -> list[Target]:
    share_ok = (
        f.share_pass1 is not None
        and f.share_pass2 is not None
        and abs(f.share_pass2 - f.share_pass1) <= SPLICE_SHARE_POINTS
    )
    share = (
        "-"
        if f.share_pass1 is None or f.share_pass2 is None
        else f"{f.share_pass2:.1f}% vs {f.share_pass1:.1f}% "
        f"({f.share_pass2 - f.share_pass1:+.1f} pts)"
    )
    sticky = "-" if f.sessions == 0 else f"{100 * f.sticky / f.sessions:.0f}%"
    overhead = "-" if f.overhead_ms is None else f"{f.overhead_ms:+.2f} ms"
    return [
        Target(
            "episodes completed",
            f"{f.completed}/{f.episodes}",
            f"{f.episodes}/{f.episodes}",
            f.completed == f.episodes > 0,
        ),
        Target("messages lost", str(f.lost_messages), "0", f.lost_messages == 0),
        Target(
            "stickiness (sessions on one worker)",
            f"{sticky} ({f.sticky}/{f.sessions})",
            "100%",
            f.sessions > 0 and f.sticky == f.sessions,
        ),
        Target(
            "splice share, pass 2 vs pass 1 (re-creations out)",
            share,
            f"within {SPLICE_SHARE_POINTS:g} pts",
            share_ok,
        ),
        Target(
            "router overhead (p50)",
            overhead,
            f"<= {OVERHEAD_MS:g} ms",
            f.overhead_ms is not None and f.overhead_ms <= OVERHEAD_MS,
        ),
        Target(
            "killed worker's sessions re-created",
            "no kill"
            if not f.killed
            else f"{f.called_again - f.unrecreated}/{f.called_again} re-created",
            "all, at least one",
            f.killed and f.called_again > 0 and f.unrecreated == 0,
        ),
    ]


def table(rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows)


def target_table(results: Sequence[Target]) -> str:
    rows = [("target", "measured", "goal", "")]
    rows += [(t.name, t.value, t.goal, "ok" if t.ok else "FAILED") for t in results]
    return table(rows)


def summarize(
    pass1: Sequence[Episode],
    pass2: Sequence[Episode],
    exchanges: Sequence[Exchange],
    fault: Fault | None,
    overhead_ms: float | None,
) -> dict[str, Any]:
    """Pass 2's figures (pass 1 for the splice share), the targets, and what is reported
    beside them: requests per worker, the splice share in each phase, re-creations."""
    second = [e for e in exchanges if e.pass_name == "pass2"]
    sessions = stickiness(second)
    answered = {k: v for k, v in sessions.items() if v}
    records1 = [r for e in pass1 for r in e.records]
    records2 = [r for e in pass2 for r in e.records]
    # Like for like: the calls of pass 1 at the places (episode, call) where pass 2
    # re-created a lost session are left out too, as those calls are in pass 2.
    recreated = {
        (e.index, j) for e in pass2 for j, r in enumerate(e.records) if r.get("resync") == RECREATED
    }
    share1 = splice_share(
        r for e in pass1 for j, r in enumerate(e.records) if (e.index, j) not in recreated
    )
    share2 = splice_share(records2, recreations=False)
    lost_ids = {r["lost_session"] for r in recreations(pass2)}
    expected: set[str] = set()
    if fault is not None:
        held = set(fault.live.get(fault.worker, ()))
        expected = {
            e.key
            for e in second
            if e.key is not None and e.key in held and e.route == CHAT_ROUTE and e.t > fault.t_kill
        }
    figures = Figures(
        episodes=len(pass2),
        completed=sum(e.completed for e in pass2),
        lost_messages=sum(e.lost() for e in pass2),
        sessions=len(answered),
        sticky=sum(len(v) == 1 for v in answered.values()),
        share_pass1=share1.percent,
        share_pass2=share2.percent,
        overhead_ms=overhead_ms,
        killed=fault is not None,
        called_again=len(expected),
        unrecreated=len(expected - lost_ids),
    )
    per_worker = Counter(e.worker or "router" for e in second)
    chat_per_worker = Counter(
        e.worker or "router" for e in second if e.route == CHAT_ROUTE and 200 <= e.status < 300
    )
    phases: dict[str, str] = {"pass 1 (one worker, direct)": share1.text()}
    if fault is not None:
        phases["pass 2 before the kill"] = splice_share(records2, until=fault.t_kill).text()
        phases["pass 2 kill to back"] = splice_share(
            records2, since=fault.t_kill, until=fault.t_back
        ).text()
        phases["pass 2 after the restart"] = splice_share(records2, since=fault.t_back).text()
    phases["pass 2 whole"] = splice_share(records2).text()
    phases["pass 2 whole, re-creations out"] = share2.text()
    return {
        "figures": asdict(figures),
        "targets": [asdict(t) for t in targets(figures)],
        "requests_per_worker": dict(sorted(per_worker.items())),
        "chat_turns_per_worker": dict(sorted(chat_per_worker.items())),
        "router_errors": dict(
            sorted(Counter(str(e.status) for e in second if e.worker is None).items())
        ),
        "splice_share": phases,
        "recreated": len(lost_ids),
        "killed_sessions_that_called_again": sorted(expected),
        "recreated_not_on_the_killed_worker": sorted(lost_ids - expected),
        "other_resyncs": dict(
            Counter(
                str(r.get("resync")) for r in records2 if r.get("resync") not in (None, RECREATED)
            )
        ),
        "lost_by_count": sum(e.lost_by_count() for e in pass2),
        "lost_by_key": sum(e.lost_by_key() for e in pass2),
        "sessions_without_a_2xx": sorted(k for k, v in sessions.items() if not v),
        "sessions_on_several_workers": {k: sorted(v) for k, v in sessions.items() if len(v) > 1},
        "call_latency_s": {
            "pass1": spread([r["latency_s"] for r in records1]),
            "pass2": spread([r["latency_s"] for r in records2]),
            "pass2 re-creations": spread([r["latency_s"] for r in recreations(pass2)]),
        },
    }


def spread(values: Sequence[float]) -> dict[str, float] | None:
    """p50, p90 and the largest of ``values`` (seconds, rounded), None for none."""
    if not values:
        return None
    return {
        "p50": round(percentile(values, 0.5), 2),
        "p90": round(percentile(values, 0.9), 2),
        "max": round(max(values), 2),
    }


def render(report: Mapping[str, Any]) -> str:
    """The printed table: the targets, then what is reported beside them."""
    s = report["settings"]
    kind = "SGLang (plugin)" if s.get("workers") == "sglang" else "leyline serve"
    lines = [
        "",
        f"router live check, {report['date']}: sglang-router {ROUTER_VERSION}, two {kind} "
        f"workers (SmolLM2, CPU, one thread each), {s['episodes']} episodes x "
        f"{s['turns']} turns, {s['policy']}, {s['concurrency']} at a time",
        "",
        target_table([Target(**t) for t in report["targets"]]),
        "",
    ]
    rows: list[tuple[str, str]] = []
    fault = report.get("fault")
    if fault:
        w = fault["worker"]
        rows.append(
            (
                "killed",
                f"worker {w} at {fault['at_turns']} turns answered; live sessions "
                + ", ".join(f"{n} {len(v)}" for n, v in fault["live"].items()),
            )
        )
        unhealthy = fault["t_unhealthy"]
        rows.append(
            (
                "timeline (s after the kill)",
                (
                    "router saw it unhealthy "
                    + ("-" if unhealthy is None else f"{unhealthy - fault['t_kill']:.1f}")
                    + f", restarted {fault['t_restart'] - fault['t_kill']:.1f}, /health "
                    f"{fault['t_up'] - fault['t_kill']:.1f}, router lists it healthy "
                    f"{fault['t_back'] - fault['t_kill']:.1f}"
                ),
            )
        )
    rows.append(("requests per worker (pass 2)", _counts(report["requests_per_worker"])))
    rows.append(("chat turns per worker (pass 2)", _counts(report["chat_turns_per_worker"])))
    if report["router_errors"]:
        rows.append(("router's own answers (waited for)", _counts(report["router_errors"])))
    rows.append(
        (
            "re-created sessions",
            f"{report['recreated']} (killed worker's sessions that "
            f"called again: {len(report['killed_sessions_that_called_again'])})",
        )
    )
    if report["recreated_not_on_the_killed_worker"]:
        rows.append(
            (
                "  of them not held by it at the kill",
                ", ".join(report["recreated_not_on_the_killed_worker"]),
            )
        )
    if report["other_resyncs"]:
        rows.append(("other re-sends", _counts(report["other_resyncs"])))
    for name, values in report["call_latency_s"].items():
        if values:
            spread_text = (
                f"p50 {values['p50']:.1f}, p90 {values['p90']:.1f}, max {values['max']:.1f}"
            )
            rows.append((f"call latency, {name} (s)", spread_text))
    rows.append(
        ("messages lost by count / by key", f"{report['lost_by_count']} / {report['lost_by_key']}")
    )
    for name, share in report["splice_share"].items():
        rows.append((f"splice share, {name}", share))
    latency = report["latency"]
    rows.append(
        (
            "router latency p50 / p90 (ms)",
            f"direct {latency['direct']['p50_ms']:.2f} / {latency['direct']['p90_ms']:.2f}, "
            f"router {latency['router']['p50_ms']:.2f} / {latency['router']['p90_ms']:.2f} "
            f"({latency['requests']} each, enveloped GET capabilities)",
        )
    )
    rows.append(("wall (s)", ", ".join(f"{k} {v:.0f}" for k, v in report["walls_s"].items())))
    lines.append(table([("reported", ""), *rows]))
    return "\n".join(lines) + "\n"


def _counts(counts: Mapping[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
