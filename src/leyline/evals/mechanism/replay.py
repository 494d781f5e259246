"""Clients that replay trajectories in both arms, turn by turn, at one concurrency level.

Each client replays one trajectory through ``LeylineOpenAI`` with the truncation policy, in
two sessions: ``splice`` (the policy's edits sent as directives) and ``reprefill`` (the same
edited messages, no directives: the server re-prefills from the first changed token and
reuses its warm prefix). A client asks both arms each turn, alternating which goes first,
so both arms share one queue and the same machine noise. ``Settings.arms_apart`` runs each
level twice instead, the ``splice`` arm's clients alone and then the ``reprefill`` arm's: each
arm then has the server to itself, so the queueing its own work causes shows in its latency.

Each arm of each level sends its own ``cache_salt``: a server's shared prefix cache (vLLM's,
SGLang's) would otherwise serve one arm the blocks the other arm (or an earlier level)
prefilled for the same trajectory, and the arms would not be two servers' worth of work.
"""

from __future__ import annotations

import difflib
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import cast

import openai

from leyline.policies import LeylineOpenAI, TruncateOldToolOutputs
from leyline.protocol.client import LeylineClient

from .shim import Clock, TimedClient
from .trajectories import Trajectory

ARMS = ("splice", "reprefill")


@dataclass(frozen=True, slots=True)
class Settings:
    levels: tuple[int, ...] = (1, 4, 8, 16)
    turns: int = 6
    keep_last: int = 2
    max_tokens: int = 4
    model: str = "smollm2"
    arms_apart: bool = False
    """Each level's clients run one arm at a time (splice, then re-prefill), not both."""


@dataclass(frozen=True, slots=True)
class Sample:
    """One chat request of one arm, as the client saw it and as the server reported it."""

    level: int
    client: int
    trajectory: str
    turn: int
    arm: str
    e2e_s: float
    """Wall time of ``create`` through the middleware (its /tokenize round trip included)."""
    ttft_s: float
    path: str | None
    prompt_tokens: int
    reused: int
    prefilled: int
    rotated: int
    directives: int
    first_token: str | None
    """The first generated token (greedy: the argmax of the next-token distribution)."""
    reusable: int | None = None
    """Tokens of the prompt found, in order, in the session's cached revision before the
    request (what any edit of that revision could have kept); None on a session's first
    request (no revision yet)."""
    started_s: float = 0.0
    """When the request was sent (``time.perf_counter``): a level's wall time and throughput."""
    queued_s: float | None = None
    """Server-reported (``leyline.timing``): waiting for the model before and between the
    slices of its edit and prefill; None where the server does not report it."""
    service_s: float | None = None
    """Server-reported: holding the model for the edit and prefill."""
    decode_s: float | None = None
    """Server-reported: the generation, batched with other requests' decode steps."""


def reusable_tokens(cached: Sequence[int], prompt: Sequence[int]) -> int:
    """Tokens of ``prompt`` that appear, in order, in ``cached``: the sum of the matching
    blocks of a diff of the two token lists (difflib, no junk heuristic)."""
    matcher = difflib.SequenceMatcher(None, list(cached), list(prompt), autojunk=False)
    return sum(block.size for block in matcher.get_matching_blocks())


class ReplayClient:
    """One simulated agent replaying one trajectory in both arms."""

    def __init__(
        self,
        base: openai.OpenAI,
        settings: Settings,
        trajectory: Trajectory,
        tag: str,
        salts: dict[str, str] | None = None,
    ) -> None:
        self.settings, self.trajectory = settings, trajectory
        self.salts = salts or {}
        """Each arm's ``cache_salt`` (none: the server's public namespace)."""
        self.messages = trajectory.opening()
        self.tools = trajectory.tool_specs()
        self.clocks = {arm: Clock() for arm in ARMS}
        root = str(base.base_url).rstrip("/").removesuffix("/v1")
        self.leyline = LeylineClient(root, api_key=base.api_key, timeout=900)
        self.cached: dict[str, list[int] | None] = {arm: None for arm in ARMS}
        policy = TruncateOldToolOutputs(keep_last=settings.keep_last)
        self.arms = {
            arm: LeylineOpenAI(
                cast(openai.OpenAI, TimedClient(base, self.clocks[arm])),
                policy,
                session=f"{tag}-{arm}",
                directives=arm == "splice",
            )
            for arm in ARMS
        }

    def turns(self) -> int:
        return min(self.settings.turns, len(self.trajectory.calls))

    def replay(
        self, level: int, index: int, tick: Callable[[], None], arms: Sequence[str] = ARMS
    ) -> list[Sample]:
        out: list[Sample] = []
        try:
            for turn in range(1, self.turns() + 1):
                self.messages += self.trajectory.turn(turn)
                order = arms if (turn + index) % 2 else arms[::-1]
                for arm in order:
                    out.append(self._ask(level, index, turn, arm))
                    tick()
        finally:
            for client in self.arms.values():
                client.close()
            self.leyline.close()
        return out

    def _ask(self, level: int, index: int, turn: int, arm: str) -> Sample:
        client, clock = self.arms[arm], self.clocks[arm]
        salt = self.salts.get(arm)
        t0 = time.perf_counter()
        client.chat.completions.create(
            extra_body={"cache_salt": salt} if salt else None,
            model=self.settings.model,
            messages=self.messages,
            tools=self.tools,
            max_tokens=self.settings.max_tokens,
            temperature=0,
            logprobs=True,
            top_logprobs=1,
        )
        e2e = time.perf_counter() - t0
        r = client.records[-1]
        reusable = self._reusable(arm, r.session, r.prompt_tokens)
        return Sample(
            level=level,
            client=index,
            trajectory=self.trajectory.name,
            turn=turn,
            arm=arm,
            e2e_s=e2e,
            ttft_s=clock.last_ttft_s,
            path=r.path,
            prompt_tokens=r.prompt_tokens or (r.reused_tokens or 0) + (r.prefilled_tokens or 0),
            reused=r.reused_tokens or 0,
            prefilled=r.prefilled_tokens or 0,
            rotated=r.rotated_tokens or 0,
            directives=r.directives,
            first_token=clock.last_first_token,
            reusable=reusable,
            started_s=t0,
            **_timing(clock.last_timing),
        )

    def _reusable(self, arm: str, session: str | None, prompt_tokens: int | None) -> int | None:
        """Reusable tokens of the request just made (outside its timing): its prompt is
        the head of the session's new revision, diffed against the revision before it."""
        if session is None or prompt_tokens is None:
            return None
        tokens = self.leyline.get_session(session, include_tokens=True).tokens or []
        before, self.cached[arm] = self.cached[arm], list(tokens)
        return None if before is None else reusable_tokens(before, tokens[:prompt_tokens])


def _timing(timing: dict[str, float] | None) -> dict[str, float | None]:
    keys = ("queued_s", "service_s", "decode_s")
    return {k: None if timing is None else timing.get(k) for k in keys}


def run_level(
    base: openai.OpenAI,
    settings: Settings,
    pool: Sequence[Trajectory],
    level: int,
    tick: Callable[[], None],
    run_id: str,
    counter: Callable[[], float] | None = None,
) -> tuple[list[Sample], dict[str, float]]:
    """``level`` clients at once; client ``i`` replays ``pool[i % len(pool)]``, in both arms
    turn by turn, or (``settings.arms_apart``) in one arm, then ``level`` fresh clients in
    the other. With ``counter`` (a server-wide count, read before and after each arm's
    clients), also how much it grew by arm: only arms apart make that growth one arm's."""
    if counter is not None and not settings.arms_apart:
        raise ValueError("a server-wide counter is one arm's only with the arms apart")
    lock = threading.Lock()

    def locked_tick() -> None:
        with lock:
            tick()

    phases = [(arm,) for arm in ARMS] if settings.arms_apart else [ARMS]
    samples: list[Sample] = []
    grown: dict[str, float] = {}
    for arms in phases:
        tag = f"{run_id}-c{level}" + (f"-{arms[0]}" if len(arms) == 1 else "")
        salts = {arm: f"{run_id}-c{level}-{arm}" for arm in arms}
        clients = [
            ReplayClient(base, settings, pool[i % len(pool)], f"{tag}-{i}", salts)
            for i in range(level)
        ]
        before = counter() if counter is not None else 0.0
        with ThreadPoolExecutor(max_workers=level) as workers:
            futures = [
                workers.submit(c.replay, level, i, locked_tick, arms) for i, c in enumerate(clients)
            ]
            samples += [s for f in futures for s in f.result()]
        if counter is not None:
            grown[arms[0]] = counter() - before
    return samples, grown


def requests_in(settings: Settings, pool: Sequence[Trajectory]) -> int:
    """How many chat requests a run makes (for the progress bar)."""
    return sum(
        2 * min(settings.turns, len(pool[i % len(pool)].calls))
        for level in settings.levels
        for i in range(level)
    )
