"""``make router-live-check``: the real sglang-router 0.3.2 in front of two real workers on
this CPU (``leyline serve``, or with ``--workers sglang`` SGLang servers with the plugin),
agent episodes through the SDK in routed mode, one worker killed in mid-run and restarted
(issue 48; docs/router-design.md section 5).

The driver owns every process it starts (their PIDs; the router's process title is
``sglang::router``, so it is never looked up by name) and stops them on every exit:

1. two workers, ``OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE leyline serve --port P
   --worker-name A|B`` (two processes share the cores; for SGLang ``scripts/sglang/
   live_server.sh run`` with ``LEYLINE_WORKER_NAME=A|B``), then the router (``--policy manual
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
import datetime
import json
import os
import platform
import signal
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
import openai

from leyline.evals.router_figures import (
    ROUTER_VERSION,
    Target,
    percentile,
    render,
    summarize,
)
from leyline.evals.router_fleet import (
    ROUTER_FLAGS,
    SGLANG_SCRIPT,
    WORKER_KINDS,
    Clock,
    Fleet,
    Say,
    fleet,
)
from leyline.evals.router_passes import (
    Collector,
    Killer,
    Pass,
    http_client,
    trajectories,
)
from leyline.protocol.routing import DEFAULT_MODEL, ROUTING_KEY, envelope_body
from leyline.serve.worker import WORKER_HEADER

# --- The router's added latency -----------------------------------------------------------


def envelope_capabilities() -> dict[str, Any]:
    """An envelope of ``GET /leyline/v1/capabilities``, as the SDK sends it in routed mode."""
    return envelope_body("GET", "/leyline/v1/capabilities", None, DEFAULT_MODEL)


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
            "scripts/router/setup_env.sh) in front of two real workers, `leyline serve` or "
            "SGLang servers with the plugin (SmolLM2, CPU): the router's added latency, "
            "then agent episodes (demo and "
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
    parser.add_argument(
        "--workers",
        choices=WORKER_KINDS,
        default="leyline",
        help="the workers: `leyline serve`, or SGLang servers with the plugin "
        f"({SGLANG_SCRIPT} run; .venv-sglang, built by the SGLang live check)",
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
        default=None,
        help="seconds for a worker or the router to come up (default: 300, SGLang 600)",
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
        help="an extra worker argument for both workers (`leyline serve`'s, or SGLang's "
        "launch flags; repeatable)",
    )
    args = parser.parse_args(argv)
    if args.episodes < 1 or args.turns < 1 or args.concurrency < 1:
        parser.error("--episodes, --turns and --concurrency must be at least 1")
    if not 0 < args.kill_at < 1:
        parser.error("--kill-at must be in (0, 1)")
    if args.start_timeout is None:
        args.start_timeout = 600.0 if args.workers == "sglang" else 300.0
    return args


def run(args: argparse.Namespace) -> int:
    clock = Clock()
    say = Say(clock)
    if not args.router_python.exists():
        say(f"no {args.router_python}: run bash scripts/router/setup_env.sh first")
        return 2
    if args.workers == "sglang" and not SGLANG_SCRIPT.exists():
        say(f"no {SGLANG_SCRIPT}: run from the repository's root")
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
    kind = "leyline serve" if args.workers == "leyline" else "SGLang (plugin)"
    phase(
        f"1/5 two {kind} workers (OMP_NUM_THREADS=1), then sglang-router "
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
