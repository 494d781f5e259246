"""Run the arms over the tasks: N episodes per (task, arm), interleaved, then the report.

Imports debug_gym: call :func:`leyline.evals.debug_gym.sandbox.isolate` first.
"""

from __future__ import annotations

import json
import platform
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

from ..common.cli import from_args
from .agent import HarnessAgent, agent_args
from .config import RunConfig
from .gym_logger import quiet_logger
from .llm import LeylineLLM
from .progress import Progress
from .records import EpisodeResult
from .report import ReportFiles, RunMeta, write_report
from .scripted import USAGE_SOURCE, ScriptedLLM
from .server import ArmPlan, ServerInfo, plan_arm, probe_server
from .tasks import TaskData, load_tasks, make_env

OBSERVATION_CHARS = 4000
"""Observations are cut to this length in the saved trajectories."""


@dataclass(frozen=True, slots=True)
class Episode:
    task: str
    plan: ArmPlan
    run: int


@dataclass(frozen=True, slots=True)
class BenchmarkRun:
    meta: RunMeta
    episodes: tuple[EpisodeResult, ...]
    files: ReportFiles


LLMFactory = Callable[[Episode, str | None], LeylineLLM]
"""``(episode, session) -> LLM``: a fresh LLM per episode (its planner is per episode)."""


def run_benchmark(config: RunConfig, llm_factory: LLMFactory | None = None) -> BenchmarkRun:
    """Probe the server, run every episode, write the report into ``config.out``.

    Raises:
        httpx.HTTPError: the endpoint does not answer (not raised in scripted mode).
        FileNotFoundError: the mini_nightmare copy is missing.
    """
    started = _now()
    if config.scripted:
        server = ServerInfo(False, "the scripted stand-in is not a Leyline server")
        model = "scripted"
    else:
        server = probe_server(config.base_url, config.api_key)
        model = config.model or _first_model(server)
    plans = tuple(plan_arm(arm, server) for arm in config.arms)
    tasks = load_tasks(config.tasks, config.data_dir)
    factory = llm_factory or _default_factory(config, model)
    episodes = [
        Episode(task, plan, run)
        for run in range(config.runs)  # interleaved: machine drift hits every arm alike
        for task in config.tasks
        for plan in plans
    ]
    config.out.mkdir(parents=True, exist_ok=True)
    log = config.out / "episodes.jsonl"
    log.write_text("", encoding="utf-8")
    done: dict[int, EpisodeResult] = {}
    with Progress(len(episodes), enabled=config.progress) as progress:
        for index, result in _run_all(episodes, tasks, config, factory):
            done[index] = result
            with log.open("a", encoding="utf-8") as f:
                f.write(json.dumps(result.to_json()) + "\n")
            progress.advance(result)
    results = [done[i] for i in sorted(done)]
    meta = from_args(  # tasks, runs, max_steps, tools and scripted as configured
        RunMeta,
        config,
        model=model,
        base_url="none (scripted)" if config.scripted else config.base_url,
        server=server.note,
        arms=plans,
        started=started,
        finished=_now(),
        usage_source=USAGE_SOURCE if config.scripted else "server usage (prompt/completion)",
        generation={"temperature": config.temperature, "max_tokens": config.max_tokens},
        versions=_versions(),
    )
    files = write_report(config.out, meta, results)
    return BenchmarkRun(meta, tuple(results), files)


def _run_all(
    episodes: list[Episode], tasks: dict[str, TaskData], config: RunConfig, factory: LLMFactory
) -> Iterator[tuple[int, EpisodeResult]]:
    """``(index, result)`` as episodes finish (threads: each episode waits on its server)."""

    def one(episode: Episode) -> EpisodeResult:
        return run_episode(episode, tasks[episode.task], config, factory)

    if config.jobs == 1:
        yield from enumerate(map(one, episodes))
        return
    with ThreadPoolExecutor(max_workers=config.jobs) as pool:
        futures = {pool.submit(one, e): i for i, e in enumerate(episodes)}
        for future in as_completed(futures):
            yield futures[future], future.result()


def run_episode(
    episode: Episode, task: TaskData, config: RunConfig, factory: LLMFactory
) -> EpisodeResult:
    """One agent run; an exception becomes an unsolved episode with its error kept."""
    session = f"dg-{episode.task}-{episode.run}-{uuid.uuid4().hex[:8]}"
    llm = factory(episode, session if episode.plan.directives else None)
    logger = quiet_logger()
    env = make_env(task, config.tools, logger, config.run_timeout)
    agent = HarnessAgent(agent_args(config.max_steps), llm=llm, logger=logger)
    error: str | None = None
    t0 = time.perf_counter()
    try:
        agent.run(env)
    except Exception as exc:  # an episode's failure must not end the run
        error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        wall = time.perf_counter() - t0
        llm.end_session()
        llm.close()
    result = EpisodeResult.from_turns(
        task=episode.task,
        arm=episode.plan.arm.name,
        run=episode.run,
        resolved=bool(env.resolved) and error is None,
        score=int(env.score or 0),
        max_score=int(env.max_score or 0),
        stop_reason="error" if error else (agent.stop_reason or "max_steps"),
        turns=llm.turns,
        wall_s=wall,
        error=error,
    )
    env.close()  # removes the task's temp copy
    _save_trajectory(config.out, episode, agent, llm, result)
    return result


def _save_trajectory(
    out: Path, episode: Episode, agent: HarnessAgent, llm: LeylineLLM, result: EpisodeResult
) -> None:
    steps: list[dict[str, Any]] = []
    for i, info in enumerate(agent.history.env_observations):
        call = info.action_tool_call
        steps.append(
            {
                "step": i + 1,
                "action": asdict(call) if call is not None else None,
                "content": info.action_content,
                "observation": str(info.step_observation.observation)[:OBSERVATION_CHARS],
                "score": info.score,
                "turn": asdict(llm.turns[i]) if i < len(llm.turns) else None,
            }
        )
    path = out / "trajectories" / episode.plan.arm.name / f"{episode.task}-run{episode.run}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"episode": result.to_json(), "policy": episode.plan.arm.policy, "steps": steps}
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


def _default_factory(config: RunConfig, model: str) -> LLMFactory:
    generate: dict[str, Any] = {}
    if config.temperature is not None:
        generate["temperature"] = config.temperature
    if config.max_tokens is not None:
        generate["max_tokens"] = config.max_tokens

    def factory(episode: Episode, session: str | None) -> LeylineLLM:
        common: dict[str, Any] = {
            "policy": episode.plan.arm.policy,
            "session": session,
            "logger": quiet_logger(),
            "context_limit_k": config.context_limit_k,
            "generate_kwargs": generate,
            "max_retries": config.max_retries,
        }
        if config.scripted:
            return ScriptedLLM(episode.task, **common)
        return LeylineLLM(model=model, base_url=config.base_url, api_key=config.api_key, **common)

    return factory


def _first_model(server: ServerInfo) -> str:
    if not server.models:
        raise ValueError("the server lists no model at /v1/models: pass --model")
    return server.models[0]


def _versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for dist in ("debug-gym", "leyline", "openai"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = "not installed"
    return versions


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
