"""``make router-live-check``: the real sglang-router 0.3.2 in front of two real ``leyline
serve`` workers on this CPU, agent episodes through the SDK in routed mode, one worker
killed in mid-run and restarted (issue 48; docs/router-design.md section 5).

The driver owns every process it starts (their PIDs; the router's process title is
``sglang::router``, so it is never looked up by name) and stops them on every exit:

1. two workers, ``OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE leyline serve --port P
   --worker-name A|B`` (two processes share the cores), then the router (``--policy manual
   --assignment-mode min_group --disable-circuit-breaker`` and short health checks), until
   its ``GET /workers`` lists both healthy;
2. the router's added latency: enveloped ``GET /leyline/v1/capabilities``, one at a time,
   straight to a worker and through the router (the same worker), interleaved;
3. pass 1, the baseline: the episodes straight to worker A, not routed;
4. pass 2: the same episodes through the router, each its own ``LeylineOpenAI(...,
   routed=True)``; once a share of the pass's turns has answered, the worker holding more
   live sessions gets SIGKILL and is started again (the same command) a few seconds later.

Counted from the SDK's call records and, through an httpx event hook on the OpenAI client,
every response's ``X-Leyline-Worker`` header: episodes completed, messages lost, requests
per worker, stickiness, re-created sessions, the splice share. ``report.json`` and a table
go to ``--out``; the exit status is 1 when a target is missed.

Run: ``.venv/bin/python -m leyline.evals.router_check --help`` (the router's venv first:
``bash scripts/router/setup_env.sh``; ``make router-live-check`` does both).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import queue
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from leyline.evals.router_figures import (
    CHAT_ROUTE,
    ROUTER_VERSION,
    Episode,
    Exchange,
    Fault,
    Target,
    message_key,
    percentile,
    render,
    summarize,
)
from leyline.evals.router_fleet import ROUTER_FLAGS, WORKER_NAMES, Clock, Fleet, Say, fleet

ROUTING_KEY = "X-SMG-Routing-Key"
WORKER_HEADER = "X-Leyline-Worker"
# --- The client side ----------------------------------------------------------------------


class Collector:
    """The event hook on the OpenAI client's http client: one :class:`Exchange` per answer,
    and the messages of each session's last answered chat request."""

    def __init__(self, clock: Clock, labels: Callable[[str], str]) -> None:
        self.clock, self.labels = clock, labels
        self.lock = threading.Lock()
        self.exchanges: list[Exchange] = []
        self.last_chat: dict[str, list[list[Any]]] = {}
        self.last_worker: dict[str, str] = {}
        """Each session's worker (name) that last answered one of its stateful requests."""
        self.pass_name = ""

    def hook(self, response: Any) -> None:
        request = response.request
        key = request.headers.get(ROUTING_KEY)
        route, body = str(request.url.path), _json(request)
        if isinstance(body, dict):
            inner = (
                (body.get("leyline") or {}).get("route") if route.endswith("/completions") else None
            )
            if isinstance(inner, dict):
                route, body = str(inner.get("path")), inner.get("body")
        name = response.headers.get(WORKER_HEADER)
        worker = None if name is None else self.labels(name)
        exchange = Exchange(
            self.clock.now(), key, route, response.status_code, worker, self.pass_name
        )
        with self.lock:
            self.exchanges.append(exchange)
            if key is None or not (200 <= exchange.status < 300) or not exchange.stateful:
                return
            self.last_worker[key] = name or ""
            if route == CHAT_ROUTE and isinstance(body, dict):
                self.last_chat[key] = [message_key(m) for m in body.get("messages") or []]


def _json(request: Any) -> Any:
    try:
        return json.loads(request.content) if request.content else None
    except (ValueError, RuntimeError, AttributeError):  # not JSON, or a streamed body
        return None


def http_client(hook: Callable[[Any], None]) -> Any:
    """The http client class the installed openai uses (httpx2 under openai 3.x, httpx
    under 1.x), with ``hook`` on every response."""
    make = getattr(openai, "DefaultHttpx2Client", None) or openai.DefaultHttpxClient
    return make(event_hooks={"response": [hook]})


@dataclass(frozen=True, slots=True)
class Replay:
    """What each episode replays and how."""

    trajectory: Any
    """A ``leyline.evals.mechanism.trajectories.Trajectory``."""
    turns: int


def trajectories(episodes: int, turns: int, seed: int) -> list[Replay]:
    """The demo's trajectory and synthetic ones, alternating."""
    from leyline.evals.mechanism.synthetic import synthetic_trajectories
    from leyline.evals.mechanism.trajectories import demo_trajectory

    demo = demo_trajectory()
    synthetic = synthetic_trajectories(max(1, episodes // 2), seed=seed, turns=max(turns, 1))
    out = []
    for i in range(episodes):
        t = demo if i % 2 == 0 else synthetic[i // 2 % len(synthetic)]
        out.append(Replay(t, min(turns, len(t.calls))))
    return out


class Pass:
    """One pass: every episode, ``concurrency`` at a time, each in its own wrapper."""

    def __init__(
        self,
        name: str,
        client: openai.OpenAI,
        replays: Sequence[Replay],
        args: argparse.Namespace,
        clock: Clock,
        *,
        routed: bool,
        run_id: str,
    ) -> None:
        self.name, self.client, self.replays, self.args = name, client, replays, args
        self.clock, self.routed, self.run_id = clock, routed, run_id
        self.lock = threading.Lock()
        self.answered = 0
        self.total = sum(r.turns for r in replays)
        self.running: dict[int, Any] = {}
        """The wrappers of the episodes in progress."""
        self.episodes: list[Episode | None] = [None] * len(replays)
        self.on_answer: Callable[[int], None] = lambda answered: None

    def live_sessions(self) -> list[str]:
        with self.lock:
            return [w.session for w in self.running.values()]

    def run(self, say: Say, timeout_s: float) -> list[Episode]:
        todo: queue.Queue[int] = queue.Queue()
        for i in range(len(self.replays)):
            todo.put(i)
        threads = [
            threading.Thread(target=self._worker, args=(todo,), daemon=True)
            for _ in range(min(self.args.concurrency, len(self.replays)))
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout_s
        last = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
            if time.monotonic() - last >= self.args.progress_s:
                last = time.monotonic()
                done = sum(e is not None for e in self.episodes)
                say(
                    f"    {self.name}: {self.answered}/{self.total} turns answered, "
                    f"episodes done {done}/{len(self.replays)}"
                )
            if time.monotonic() > deadline:
                say(f"    {self.name}: not done after {timeout_s:g} s; the rest count as failed")
                break
        out = []
        for i, r in enumerate(self.replays):
            e = self.episodes[i]
            out.append(e or Episode(i, r.trajectory.name, r.turns, error="did not finish in time"))
        return out

    def _worker(self, todo: queue.Queue[int]) -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            self.episodes[index] = self._episode(index)

    def _episode(self, index: int) -> Episode:
        from leyline.policies import EstimateCounter, LeylineOpenAI

        replay = self.replays[index]
        t = replay.trajectory
        episode = Episode(index, t.name, replay.turns)
        wrapper = LeylineOpenAI(
            self.client,
            self.args.policy,
            session=f"rc-{self.run_id}-{self.name}-{index:02d}",
            counter=EstimateCounter(),
            routed=self.routed,
            unreachable_s=self.args.unreachable_s,
        )
        with self.lock:
            self.running[index] = wrapper
        messages, tools = t.opening(), t.tool_specs()
        answered: dict[int, float] = {}
        try:
            for turn in range(1, replay.turns + 1):
                messages += t.turn(turn)
                episode.agent_messages = [message_key(m) for m in messages]
                wrapper.chat.completions.create(
                    model=self.args.model,
                    messages=messages,
                    tools=tools,
                    max_tokens=self.args.max_tokens,
                    temperature=0,
                )
                answered[wrapper.records[-1].call] = self.clock.now()
                episode.answered += 1
                with self.lock:
                    self.answered += 1
                    count = self.answered
                self.on_answer(count)
        except Exception as exc:  # the episode stops; the pass goes on
            episode.error = f"{type(exc).__name__}: {exc}"[:500]
        finally:
            with self.lock:
                self.running.pop(index, None)
            for r in wrapper.records:
                record = r.to_json()
                record["answered_s"] = answered.get(r.call)
                episode.records.append(record)
                if not episode.sessions or episode.sessions[-1] != r.session:
                    episode.sessions.append(str(r.session))
            with contextlib.suppress(Exception):  # best effort, as the SDK's own close
                wrapper.close()
        return episode


class Killer:
    """Pass 2's fault: once ``at_turns`` turns have answered, SIGKILL the worker holding
    more live sessions, start it again ``restart_after_s`` later, and wait until the router
    shows it healthy again."""

    def __init__(
        self,
        fleet: Fleet,
        run: Pass,
        collector: Collector,
        args: argparse.Namespace,
        clock: Clock,
        say: Say,
    ) -> None:
        self.fleet, self.run, self.collector, self.args = fleet, run, collector, args
        self.clock, self.say = clock, say
        self.at_turns = max(1, math.ceil(args.kill_at * run.total))
        self.reached = threading.Event()
        self.fault: Fault | None = None
        self.error: str | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def on_answer(self, answered: int) -> None:
        if answered >= self.at_turns:
            self.reached.set()

    def start(self) -> None:
        self.thread.start()

    def join(self, timeout_s: float) -> None:
        self.reached.set()  # a pass that ended early: kill now, so the restart is checked
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            self.error = f"the restart did not finish in {timeout_s:g} s"

    def _run(self) -> None:
        try:
            self._fault()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"

    def _fault(self) -> None:
        self.reached.wait()
        at = self.run.answered
        live: dict[str, list[str]] = {n: [] for n in self.fleet.workers}
        with self.collector.lock:
            for session in self.run.live_sessions():
                name = self.collector.last_worker.get(session)
                if name in live:
                    live[name].append(session)
        victim = max(self.fleet.workers, key=lambda n: (len(live[n]), n == WORKER_NAMES[0]))
        worker = self.fleet.workers[victim]
        counts = ", ".join(f"{n} {len(s)}" for n, s in live.items())
        worker.kill()
        t_kill = self.clock.now()
        self.say(
            f"    pass2: {at}/{self.run.total} turns answered, live sessions {counts}: "
            f"SIGKILL worker {victim} (pid {worker.pid})"
        )
        t_unhealthy = None
        restart_at = t_kill + self.args.restart_after
        while self.clock.now() < restart_at:
            if t_unhealthy is None and not self.fleet.router.health().get(worker.url, True):
                t_unhealthy = self.clock.now()
            time.sleep(0.2)
        worker.start()
        t_restart = self.clock.now()
        noticed = (
            ""
            if t_unhealthy is None
            else f"; the router marked it unhealthy {t_unhealthy - t_kill:.1f} s after the kill"
        )
        self.say(f"    pass2: worker {victim} started again (pid {worker.pid}){noticed}")
        worker.wait_healthy(self.args.start_timeout)
        t_up = self.clock.now()
        self.fleet.router.wait_until(
            lambda h: h.get(worker.url, False),
            self.args.start_timeout,
            f"worker {victim} healthy again",
        )
        t_back = self.clock.now()
        self.say(
            f"    pass2: worker {victim} answers /health after {t_up - t_restart:.1f} s, "
            f"listed healthy by the router {t_back - t_up:.1f} s later"
        )
        self.fault = Fault(victim, live, at, t_kill, t_unhealthy, t_restart, t_up, t_back)


# --- The router's added latency -----------------------------------------------------------


def envelope_capabilities() -> dict[str, Any]:
    """An envelope of ``GET /leyline/v1/capabilities``, as the SDK sends it in routed mode."""
    route = {"method": "GET", "path": "/leyline/v1/capabilities", "body": None}
    return {
        "model": "default",
        "prompt": ".",
        "max_tokens": 1,
        "stream": False,
        "leyline": {"route": route},
    }


def measure_overhead(fleet: Fleet, requests: int, warmup: int, run_id: str) -> dict[str, Any]:
    """``requests`` enveloped capabilities requests straight to a worker and as many
    through the router with a routing key bound to that worker, one at a time and
    interleaved (keep-alive connections, as the SDK's client)."""
    body = envelope_capabilities()
    headers = {ROUTING_KEY: f"rc-{run_id}-latency"}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=30) as direct, httpx.Client(timeout=30) as routed:
        first = routed.post(f"{fleet.router.url}/v1/completions", json=body, headers=headers)
        first.raise_for_status()
        name = first.headers[WORKER_HEADER]
        target = fleet.workers[name].url
        urls = {
            "direct": f"{target}/v1/completions",
            "router": f"{fleet.router.url}/v1/completions",
        }
        clients = {"direct": direct, "router": routed}
        for i in range(warmup + requests):
            order = ("direct", "router") if i % 2 else ("router", "direct")
            for arm in order:
                t0 = time.perf_counter()
                answer = clients[arm].post(urls[arm], json=body, headers=headers)
                elapsed = time.perf_counter() - t0
                if answer.status_code != 200 or answer.headers.get(WORKER_HEADER) != name:
                    raise RuntimeError(
                        f"{arm}: HTTP {answer.status_code} from {answer.headers.get(WORKER_HEADER)}"
                    )
                if i >= warmup:
                    times[arm].append(elapsed * 1000)
    out: dict[str, Any] = {"worker": name, "requests": requests, "warmup": warmup}
    for arm, values in times.items():
        out[arm] = {"p50_ms": statistics.median(values), "p90_ms": percentile(values, 0.9)}
    out["overhead_p50_ms"] = out["router"]["p50_ms"] - out["direct"]["p50_ms"]
    out["overhead_p90_ms"] = out["router"]["p90_ms"] - out["direct"]["p90_ms"]
    return out


# --- The run ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m leyline.evals.router_check",
        description=(
            "The real sglang-router (from --router-python's venv, built by "
            "scripts/router/setup_env.sh) in front of two real `leyline serve` workers "
            "(SmolLM2, CPU): the router's added latency, then agent episodes (demo and "
            "synthetic trajectories, alternating) straight to one worker (pass 1) and "
            "through the router in routed mode (pass 2), where the worker holding more live "
            "sessions is killed (SIGKILL) once --kill-at of the turns have answered and "
            "started again --restart-after seconds later. Writes OUT/report.json, prints a "
            "table of targets, exits 1 if one is missed. Every process it starts is stopped "
            "on exit."
        ),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("results/router-live-check"),
        help="folder for report.json and the processes' logs",
    )
    parser.add_argument(
        "--router-python",
        type=Path,
        default=Path(".venv-router/bin/python"),
        help=f"the Python of a venv with sglang-router=={ROUTER_VERSION}",
    )
    parser.add_argument("--episodes", type=int, default=16, help="agent episodes per pass")
    parser.add_argument("--turns", type=int, default=5, help="turns (tool calls) per episode")
    parser.add_argument("--concurrency", type=int, default=8, help="episodes at a time")
    parser.add_argument("--policy", default="truncate:keep_last=2", help="the SDK's policy")
    parser.add_argument("--max-tokens", type=int, default=4, help="tokens per reply")
    parser.add_argument("--model", default="smollm2", help="the model name the agent sends")
    parser.add_argument("--seed", type=int, default=0, help="of the synthetic trajectories")
    parser.add_argument(
        "--kill-at",
        type=float,
        default=0.4,
        help="share of pass 2's turns answered when the worker is killed",
    )
    parser.add_argument(
        "--restart-after", type=float, default=5.0, help="seconds between the kill and the restart"
    )
    parser.add_argument(
        "--unreachable-s",
        type=float,
        default=60.0,
        help="the SDK's wait for a worker the router cannot reach",
    )
    parser.add_argument(
        "--latency-requests",
        type=int,
        default=200,
        help="requests per arm (direct, through the router) for the overhead",
    )
    parser.add_argument("--latency-warmup", type=int, default=20)
    parser.add_argument(
        "--start-timeout",
        type=float,
        default=300,
        help="seconds for a worker or the router to come up",
    )
    parser.add_argument(
        "--pass-timeout",
        type=float,
        default=900,
        help="seconds a pass may take; episodes not done by then fail",
    )
    parser.add_argument(
        "--progress-s", type=float, default=20, help="seconds between progress lines during a pass"
    )
    parser.add_argument(
        "--worker-option",
        action="append",
        default=[],
        help="an extra `leyline serve` argument for both workers (repeatable)",
    )
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.turns < 1 or args.concurrency < 1:
        parser.error("--episodes, --turns and --concurrency must be at least 1")
    if not 0 < args.kill_at < 1:
        parser.error("--kill-at must be in (0, 1)")
    return args


def run(args: argparse.Namespace) -> int:
    clock = Clock()
    say = Say(clock)
    if not args.router_python.exists():
        say(f"no {args.router_python}: run bash scripts/router/setup_env.sh first")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    run_id = f"{os.getpid():x}{int(time.time()) % 100000:05d}"
    started = datetime.datetime.now(datetime.UTC)
    walls: dict[str, float] = {}
    phase_t = clock.now()

    def phase(message: str) -> None:
        nonlocal phase_t
        phase_t = clock.now()
        say(message)

    def done(name: str) -> None:
        walls[name] = round(clock.now() - phase_t, 1)
        say(f"    {name}: {walls[name]:.1f} s")

    replays = trajectories(args.episodes, args.turns, args.seed)
    turns = sum(r.turns for r in replays)
    say(
        f"{args.episodes} episodes, {turns} turns a pass ({args.policy}, max_tokens "
        f"{args.max_tokens}, {args.concurrency} at a time); out: {args.out}"
    )
    phase(
        "1/5 two leyline serve workers (OMP_NUM_THREADS=1), then sglang-router "
        f"{ROUTER_VERSION} ({' '.join(ROUTER_FLAGS)})"
    )
    with fleet(args, args.out, say) as f:
        done("fleet start")
        phase(
            f"2/5 the router's added latency: {args.latency_requests} enveloped "
            "capabilities requests each way, interleaved"
        )
        latency = measure_overhead(f, args.latency_requests, args.latency_warmup, run_id)
        say(
            f"    direct to {latency['worker']} p50 {latency['direct']['p50_ms']:.2f} ms, "
            f"through the router {latency['router']['p50_ms']:.2f} ms: "
            f"{latency['overhead_p50_ms']:+.2f} ms"
        )
        done("latency")

        collector = Collector(
            clock, lambda name: f.workers[name].label() if name in f.workers else name
        )
        http = http_client(collector.hook)
        try:

            def client(url: str) -> openai.OpenAI:
                return openai.OpenAI(
                    base_url=f"{url}/v1",
                    api_key="-",
                    http_client=http,
                    max_retries=0,
                    timeout=args.pass_timeout,
                )

            phase(
                f"3/5 pass 1, the baseline: the episodes straight to worker A {f.workers['A'].url}"
            )
            collector.pass_name = "pass1"
            first = Pass(
                "pass1",
                client(f.workers["A"].url),
                replays,
                args,
                clock,
                routed=False,
                run_id=run_id,
            )
            pass1 = first.run(say, args.pass_timeout)
            done("pass 1")

            phase(
                f"4/5 pass 2: the same episodes through the router (routed=True); a worker "
                f"killed at {args.kill_at:.0%} of the turns, started again "
                f"{args.restart_after:g} s later"
            )
            collector.pass_name = "pass2"
            second = Pass(
                "pass2", client(f.router.url), replays, args, clock, routed=True, run_id=run_id
            )
            killer = Killer(f, second, collector, args, clock, say)
            second.on_answer = killer.on_answer
            killer.start()
            pass2 = second.run(say, args.pass_timeout)
            killer.join(args.start_timeout + args.restart_after + 30)
            done("pass 2")
        finally:
            http.close()
        for e in [*pass1, *pass2]:
            e.sent_messages = collector.last_chat.get(e.sessions[-1]) if e.sessions else None
        phase("5/5 the figures; stopping the router and the workers")
    fault = killer.fault
    summary = summarize(pass1, pass2, collector.exchanges, fault, latency["overhead_p50_ms"])
    if killer.error:
        summary["targets"].append(asdict(Target("kill and restart", killer.error, "done", False)))
    report = {
        "date": started.isoformat(timespec="seconds"),
        "command": " ".join([sys.executable, "-m", "leyline.evals.router_check", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_avg_1m_end": round(os.getloadavg()[0], 2),
            "python": platform.python_version(),
            "openai": openai.__version__,
        },
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "router": {"version": ROUTER_VERSION, "flags": list(ROUTER_FLAGS)},
        "walls_s": walls,
        "pass_wall_s": {
            "pass1": walls.get("pass 1"),
            "pass2": walls.get("pass 2"),
        },
        "latency": latency,
        "fault": None if fault is None else asdict(fault),
        **summary,
        "exchanges": [
            [round(e.t, 3), e.pass_name, e.key, e.route, e.status, e.worker]
            for e in collector.exchanges
        ],
        "episodes": {
            "pass1": [asdict(e) for e in pass1],
            "pass2": [asdict(e) for e in pass2],
        },
    }
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(render(report))
    failed = [t["name"] for t in report["targets"] if not t["ok"]]
    say(
        f"report: {args.out / 'report.json'}; "
        + ("FAILED: " + ", ".join(failed) if failed else "every target met")
    )
    return 1 if failed else 0


def _terminate(signum: int, frame: object) -> None:
    print(f"[router-check] signal {signum}: stopping the processes", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _terminate)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("[router-check] interrupted; the processes were stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
