"""The memory-pressure scenario: agents replayed round-robin on one reference server.

Each arm runs on a fresh ``LeylineService`` over the real SmolLM2 weights (the service the
HTTP routes call, in-process: the figures are the cache's, not HTTP's), with no shared
prefix cache, so a session's bytes are the only KV kept and an evicted conversation has
nowhere to come back from but a prefill.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from leyline.protocol import ErrorCode, LeylineError, Limits

from ..common.progress import progress
from ..mechanism.synthetic import synthetic_trajectories
from ..mechanism.trajectories import Trajectory
from .report import write_report

STUB = "[tool output dropped under memory pressure]"


@dataclass(frozen=True, slots=True)
class Config:
    agents: int = 4
    turns: int = 8
    budget: float = 0.6
    mode: str = "amortize"
    seed: int = 0
    threads: int = 1
    progress: bool = True
    max_session_tokens: int = 8192


@dataclass(slots=True)
class Turn:
    """One chat turn of one agent, as the arm's client saw it."""

    agent: int
    turn: int
    prompt_tokens: int
    prefilled: int
    new_tokens: int
    """Tokens of the messages this turn added (what a perfect cache would prefill)."""
    seconds: float
    first_token: int
    evicted_before: bool = False
    retries: int = 0
    dropped: int = 0


@dataclass(slots=True)
class Agent:
    """A client's state: its transcript, what it knows of its session, what was dropped."""

    index: int
    trajectory: Trajectory
    messages: list[dict[str, Any]] = field(default_factory=list)
    revision: int | None = None
    spans: list[Any] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)
    """Indices of messages whose content the server dropped (the stub stands there now)."""

    @property
    def session(self) -> str:
        return f"agent-{self.index}"


def run_pressure(config: Config, out: Path | None = None) -> Path:
    import torch

    from leyline.engine.engine import Engine
    from leyline.engine.models import load_model

    torch.set_num_threads(config.threads)
    out = out or Path("results") / f"pressure-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    engine = Engine(load_model("smollm2"), limits=Limits(max_session_tokens=8192))
    trajectories = synthetic_trajectories(config.agents, seed=config.seed, turns=config.turns)

    reference, held = _arm("unbounded", engine, trajectories, config, budget=None)
    budget = int(config.budget * held)
    evict, _ = _arm("evict", engine, trajectories, config, budget=budget)
    decay, _ = _arm("decay", engine, trajectories, config, budget=budget)
    arms = {"unbounded": reference, "evict": evict, "decay": decay}
    summary = {name: summarize(turns, reference) for name, turns in arms.items()}
    report = {
        "config": asdict(config),
        "bytes_held_unbounded": held,
        "budget_bytes": budget,
        "seconds": time.perf_counter() - t0,
        "summary": summary,
        "turns": {name: [asdict(t) for t in turns] for name, turns in arms.items()},
    }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    write_report(out, report)
    return out


def _arm(
    name: str,
    engine: Any,
    trajectories: list[Trajectory],
    config: Config,
    *,
    budget: int | None,
) -> tuple[list[Turn], int]:
    """Replay every agent round-robin on a fresh service; (turns, bytes held at the end)."""
    from leyline.engine.backend import EngineBackend
    from leyline.serve.service import LeylineService
    from leyline.serve.settings import ServerSettings

    settings = ServerSettings(
        max_new_tokens=1,
        max_session_tokens=config.max_session_tokens,
        max_cache_bytes=budget if budget is not None else 1 << 40,
    )
    backend = EngineBackend(engine, limits=settings.limits, model_name="smollm2")
    service = LeylineService(backend, settings, model_name="smollm2")
    agents = [Agent(i, t, t.opening()) for i, t in enumerate(trajectories)]
    turns: list[Turn] = []
    steps = [(turn, agent) for turn in range(1, config.turns + 1) for agent in agents]
    try:
        for turn, agent in progress(steps, desc=f"{name} arm", enabled=config.progress):
            exchange = agent.trajectory.turn(turn)
            agent.messages.extend(exchange)
            turns.append(_turn(service, agent, turn, exchange, name == "decay", config))
        held = service.sessions.total_bytes()
    finally:
        backend.shutdown()
    return turns, held


def _turn(
    service: Any,
    agent: Agent,
    turn: int,
    exchange: list[dict[str, Any]],
    decay: bool,
    config: Config,
) -> Turn:
    from leyline.core.openai_types import ChatCompletionRequest

    evicted = agent.revision is not None and not service.sessions.exists("default", agent.session)
    new_tokens = _tokens_of(service, agent.messages) - _tokens_of(
        service, agent.messages[: -len(exchange)]
    )
    retries = 0
    t0 = time.perf_counter()
    while True:
        leyline: dict[str, Any] = {"session": agent.session}
        if decay and agent.revision is not None and not evicted:
            leyline["base_revision"] = agent.revision
            marks = _decay_marks(agent, turn, config.mode)
            if marks:
                leyline["directives"] = marks
        body = {
            "model": "m",
            "messages": _transcript(agent),
            "max_tokens": 1,
            "temperature": 0,
            "leyline": leyline,
        }
        request = ChatCompletionRequest.model_validate(body)
        try:
            reply = asyncio.run(service.chat(request))
            break
        except LeylineError as exc:
            retries += 1
            if exc.code is ErrorCode.revision_conflict and retries < 4:
                _mirror_drops(service, agent)  # the server dropped spans: put the stubs in
                continue
            if exc.code is ErrorCode.unknown_session and retries < 4:
                evicted = True  # evicted after all: a plain request recreates it
                continue
            raise
    seconds = time.perf_counter() - t0
    ley = reply.leyline
    agent.revision, agent.spans = ley.revision, list(ley.spans)
    return Turn(
        agent.index,
        turn,
        reply.prompt_tokens,
        ley.prefilled_tokens,
        new_tokens,
        seconds,
        int(reply.generation.tokens[0]) if reply.generation.tokens else -1,
        evicted,
        retries,
        len(ley.dropped),
    )


def _decay_marks(agent: Agent, turn: int, mode: str) -> list[dict[str, Any]]:
    """Mark the previous turn's tool output ``decay`` (priority: its turn: older first)."""
    if turn < 2:
        return []
    index = len(agent.messages) - 3  # [..., tool(t-1), assistant(t), tool(t)]
    if index in agent.dropped or index >= len(agent.spans):
        return []
    span = agent.spans[index]
    if span.role != "tool" or span.content is None:
        return []
    mark = {"message": index, "part": "content"}
    return [{"verb": "decay", "span": mark, "priority": turn - 1, "mode": mode,
             "replacement": STUB}]  # fmt: skip


def _mirror_drops(service: Any, agent: Agent) -> None:
    """Read what the server dropped (the session's ``dropped``) and put each stub where its
    span was: the spans are in successive revisions, so each shifts the ones after it."""
    info = asyncio.run(service.core.get("default", agent.session))
    spans = [(s.content.start, s.content.end) if s.content else (-1, -1) for s in agent.spans]
    for drop in info.dropped:
        index = spans.index((drop.start, drop.end))
        agent.dropped.add(index)
        shift = drop.replacement_tokens - (drop.end - drop.start)
        spans = [(a + shift, b + shift) if a >= drop.end else (a, b) for a, b in spans]
    agent.revision = info.revision
    agent.spans = list(info.spans)


def _transcript(agent: Agent) -> list[dict[str, Any]]:
    return [
        m | {"content": STUB} if i in agent.dropped else m for i, m in enumerate(agent.messages)
    ]


def _tokens_of(service: Any, messages: list[dict[str, Any]]) -> int:
    from leyline.core.openai_types import ChatCompletionRequest

    request = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    rendered = service.backend.renderer.render(request.messages, None, add_generation_prompt=True)
    return len(rendered.tokens)


def summarize(turns: list[Turn], reference: list[Turn]) -> dict[str, Any]:
    """Totals and medians of one arm; agreement of its first tokens with the reference's."""
    seconds = sorted(t.seconds for t in turns)
    agree = sum(a.first_token == b.first_token for a, b in zip(turns, reference, strict=True))
    return {
        "turns": len(turns),
        "prompt_tokens": sum(t.prompt_tokens for t in turns),
        "prefilled_tokens": sum(t.prefilled for t in turns),
        "new_tokens": sum(t.new_tokens for t in turns),
        "re_prefilled_tokens": sum(max(t.prefilled - t.new_tokens, 0) for t in turns),
        "evictions_seen": sum(t.evicted_before for t in turns),
        "spans_dropped": sum(t.dropped for t in turns),
        "retries": sum(t.retries for t in turns),
        "latency_p50_s": statistics.median(seconds),
        "latency_p90_s": seconds[min(len(seconds) - 1, int(0.9 * len(seconds)))],
        "latency_total_s": sum(seconds),
        "first_token_agreement": agree / len(turns),
    }
