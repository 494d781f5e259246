"""The agent side of ``make router-live-check`` (``router_check``): the episodes of one
pass, each its own SDK client, replayed concurrently; every answer's worker seen through an
event hook on the client; and the kill of a worker once a share of the pass's turns has
answered, with its restart."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import openai

from leyline.evals.router_figures import (
    CHAT_ROUTE,
    Episode,
    Exchange,
    Fault,
    message_key,
)
from leyline.evals.router_fleet import WORKER_NAMES, Clock, Fleet, Say
from leyline.policies.middleware_wire import ROUTING_KEY
from leyline.serve.worker import WORKER_HEADER


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
        t_kill = self.clock.now()  # the signal's time: a big process takes seconds to exit
        worker.kill()
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
