"""The harness end to end on real mini_nightmare tasks, driven by the SCRIPTED stand-in.

No model and no server: :class:`ScriptedLLM` answers with fixed tool calls (it fixes
shopping_cart and purr and gives up on config), everything else is the real path
(debug-gym's env, tools, agent loop and scoring; the planner and the policy). A run must
count exactly the two fixed tasks as solved, under every arm.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion

from leyline.evals.common.stats import wilson
from leyline.evals.debug_gym.config import DEFAULT_POLICY, RunConfig, make_arms
from leyline.evals.debug_gym.gym_logger import quiet_logger
from leyline.evals.debug_gym.llm import LeylineLLM
from leyline.evals.debug_gym.records import EpisodeResult
from leyline.evals.debug_gym.report import SCRIPTED_BANNER
from leyline.evals.debug_gym.runner import (
    BenchmarkRun,
    Episode,
    LLMFactory,
    run_benchmark,
    run_episode,
)
from leyline.evals.debug_gym.scripted import (
    SCRIPTS,
    SUBMIT,
    ScriptedLLM,
    scripted_completion,
)
from leyline.evals.debug_gym.server import ArmPlan
from leyline.evals.debug_gym.tasks import load_tasks

TASKS = ("shopping_cart", "purr", "config")
SOLVED = {"shopping_cart", "purr"}


def factory_into(
    llms: dict[tuple[str, str], ScriptedLLM], cls: type[ScriptedLLM] = ScriptedLLM
) -> LLMFactory:
    def factory(episode: Episode, session: str | None) -> ScriptedLLM:
        llm = cls(
            episode.task,
            policy=episode.plan.arm.policy,
            session=session,
            logger=quiet_logger(),
            max_retries=0,
        )
        llms[(episode.plan.arm.name, episode.task)] = llm
        return llm

    return factory


@dataclass(frozen=True)
class Captured:
    run: BenchmarkRun
    llms: dict[tuple[str, str], ScriptedLLM]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Captured:
    """One run: 3 tasks x arms none and splice (no Leyline here: degraded) x 1 episode."""
    llms: dict[tuple[str, str], ScriptedLLM] = {}
    config = RunConfig(
        tasks=TASKS,
        runs=1,
        arms=make_arms(["none", "splice"], DEFAULT_POLICY),
        out=tmp_path_factory.mktemp("scripted"),
        scripted=True,
        progress=False,
        jobs=2,  # also exercises parallel episodes
    )
    return Captured(run_benchmark(config, llm_factory=factory_into(llms)), llms)


def test_scripted_runs_solve_the_fixed_tasks_and_not_the_other(scripted: Captured) -> None:
    got = {(e.arm, e.task): e for e in scripted.run.episodes}
    assert set(got) == {(a, t) for a in ("none", "splice") for t in TASKS}
    for (_arm, task), e in got.items():
        assert e.error is None
        assert e.resolved == (task in SOLVED)
        assert (e.score == e.max_score) == (task in SOLVED)
    assert got["none", "shopping_cart"].stop_reason == "resolved"
    assert got["none", "shopping_cart"].steps == 5  # eval, view, view, edit, eval
    config = got["splice", "config"]
    assert (config.stop_reason, config.steps, config.max_score) == ("submitted", 2, 2)


def test_the_report_counts_two_of_three_per_arm(scripted: Captured) -> None:
    run = scripted.run
    data = run.files.json.read_text()
    assert '"scripted": true' in data
    md = run.files.markdown.read_text()
    low, high = wilson(2, 3)
    assert f"| none | 2/3 | 66.7% [{100 * low:.1f}, {100 * high:.1f}]" in md
    assert "splice DEGRADED to re-prefill (the scripted stand-in is not a Leyline server)" in md
    assert SCRIPTED_BANNER in md
    out = run.files.json.parent
    assert len((out / "episodes.jsonl").read_text().splitlines()) == 6
    assert (out / "trajectories" / "splice" / "purr-run0.json").is_file()


def test_the_policy_arm_sends_stubs_and_the_plain_arm_the_full_history(
    scripted: Captured,
) -> None:
    def tool_texts(arm: str) -> list[str]:
        last = scripted.llms[arm, "shopping_cart"].requests[-1]
        return [m["content"] for m in last["messages"] if m["role"] == "tool"]

    plain, edited = tool_texts("none"), tool_texts("splice")
    assert len(plain) == len(edited) == 4  # the same turns, only outputs replaced
    assert not any(t.startswith("[evicted:") for t in plain)
    assert [t.startswith("[evicted:") for t in edited] == [True, True, False, False]
    assert edited[2:] == plain[2:]
    # A degraded splice arm sends no Leyline object at all.
    assert all("extra_body" not in r for r in scripted.llms["splice", "purr"].requests)


class EmulatedLeylineServer:
    """An EMULATED OpenAI-compatible Leyline server behind ``httpx.MockTransport``.

    It answers with the task's scripted tool calls plus a ``leyline`` object (revision and
    path; token counts are zero): wiring only. Request number ``conflict_at`` gets a 409
    ``revision_conflict`` Leyline error instead.
    """

    def __init__(self, task: str, conflict_at: int | None = None) -> None:
        self.script, self.conflict_at = SCRIPTS[task], conflict_at
        self.bodies: list[dict[str, Any]] = []
        self.deleted: list[str] = []
        self.revision = 0

    def handle(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.deleted.append(request.url.path)
            return httpx.Response(204)
        body = json.loads(request.content)
        self.bodies.append(body)
        if len(self.bodies) - 1 == self.conflict_at:
            error = {"code": "revision_conflict", "message": "stale", "param": "base_revision"}
            return httpx.Response(409, json={"error": error})
        step = self.revision  # one scripted call per answered request
        name, arguments = self.script[step] if step < len(self.script) else SUBMIT
        data = scripted_completion(step, name, arguments, body["messages"])
        sent = body["leyline"]
        self.revision += 1
        data["leyline"] = {
            "session": sent["session"],
            "revision": self.revision,
            "path": "splice" if sent.get("directives") else "prefix_hit",
            "reused_tokens": 0,
            "prefilled_tokens": 0,
            "rotated_tokens": 0,
        }
        return httpx.Response(200, json=data)


def run_against(server: EmulatedLeylineServer, tmp_path: Path) -> EpisodeResult:
    """One splice-arm episode of shopping_cart through LeylineLLM's real HTTP client."""

    def factory(episode: Episode, session: str | None) -> LeylineLLM:
        llm = LeylineLLM(
            model="emulated",
            base_url="http://emulated/v1",
            api_key="k",
            policy=episode.plan.arm.policy,
            session=session,
            logger=quiet_logger(),
            max_retries=0,
            http_client=httpx.Client(transport=httpx.MockTransport(server.handle)),
        )
        return llm

    config = RunConfig(tasks=("shopping_cart",), out=tmp_path, progress=False)
    task = load_tasks(["shopping_cart"])["shopping_cart"]
    arm = make_arms(["splice"], DEFAULT_POLICY)[0]
    episode = Episode("shopping_cart", ArmPlan(arm, directives=True), 0)
    return run_episode(episode, task, config, factory)


def test_the_splice_arm_sends_directives_in_one_session_over_http(tmp_path: Path) -> None:
    server = EmulatedLeylineServer("shopping_cart")
    result = run_against(server, tmp_path)
    sent = [body["leyline"] for body in server.bodies]
    assert len({s["session"] for s in sent}) == 1
    assert all(b["tools"] and b["tool_choice"] == "auto" for b in server.bodies)
    # Each batch of directives addresses the revision the previous answer reported.
    spliced = [(i, s) for i, s in enumerate(sent) if s["directives"]]
    assert [s["base_revision"] for i, s in spliced] == [i for i, _ in spliced]
    assert all("base_revision" not in s for s in sent if not s["directives"])
    verbs = [d["verb"] for _, s in spliced for d in s["directives"]]
    assert verbs and set(verbs) == {"splice"}
    assert result.resolved and result.directives == len(verbs) and result.fallbacks == 0
    assert result.leyline_turns == result.steps == 5
    assert server.deleted == [f"/leyline/v1/sessions/{sent[0]['session']}"]  # freed at the end


def test_a_refused_batch_is_resent_plain_and_the_session_goes_on(tmp_path: Path) -> None:
    server = EmulatedLeylineServer("shopping_cart", conflict_at=3)  # the first batch
    result = run_against(server, tmp_path)
    refused, resent = server.bodies[3]["leyline"], server.bodies[4]["leyline"]
    assert refused["directives"] and not resent["directives"]
    assert resent["session"] == refused["session"]
    assert result.sessions_dropped == 1 and result.resolved
    # The next turn splices again, against the revision the plain re-send created.
    assert server.bodies[5]["leyline"]["directives"]


class Wanderer(ScriptedLLM):
    """Views the same file forever: never fixes, never submits."""

    def __init__(self, task: str, **kwargs: Any) -> None:
        super().__init__(task, **kwargs)
        self.script = (("view", {"path": "purr_code.py"}),) * 100


def test_max_steps_ends_an_episode_that_never_submits(tmp_path: Path) -> None:
    config = RunConfig(tasks=("purr",), out=tmp_path, max_steps=4, scripted=True, progress=False)
    task = load_tasks(["purr"])["purr"]
    episode = Episode("purr", ArmPlan(make_arms(["none"], DEFAULT_POLICY)[0], False), 0)
    result = run_episode(episode, task, config, factory_into({}, Wanderer))
    # debug-gym stops once step + 1 >= max_steps: max_steps - 1 model calls.
    assert (result.stop_reason, result.steps, result.resolved) == ("max_steps", 3, False)


class Mute(ScriptedLLM):
    """Its first two replies carry no tool call (debug-gym names both the same)."""

    def _send(self, **kwargs: Any) -> ChatCompletion:
        completion = super()._send(**kwargs)
        if len(self.requests) > 2:
            return completion
        data = completion.model_dump()
        data["choices"][0]["message"]["tool_calls"] = None
        return ChatCompletion.model_validate(data)


def test_replies_without_a_tool_call_do_not_break_the_policy(tmp_path: Path) -> None:
    llms: dict[tuple[str, str], ScriptedLLM] = {}
    config = RunConfig(tasks=("purr",), out=tmp_path, scripted=True, progress=False)
    task = load_tasks(["purr"])["purr"]
    episode = Episode("purr", ArmPlan(make_arms(["reprefill"], DEFAULT_POLICY)[0], False), 0)
    result = run_episode(episode, task, config, factory_into(llms, Mute))
    assert result.error is None and result.resolved and result.steps == 4
    last = llms["reprefill", "purr"].requests[-1]["messages"]
    ids = [c["id"] for m in last if m["role"] == "assistant" for c in m["tool_calls"]]
    assert ids[:2] == ["empty_tool_response", "empty_tool_response-1"]


class Unreachable(ScriptedLLM):
    def _send(self, **kwargs: Any) -> ChatCompletion:
        raise openai.APIConnectionError(request=httpx.Request("POST", "http://127.0.0.1:9/v1"))


def test_a_failing_server_gives_an_unsolved_episode_that_keeps_its_error(
    tmp_path: Path,
) -> None:
    config = RunConfig(tasks=("purr",), out=tmp_path, scripted=True, progress=False)
    task = load_tasks(["purr"])["purr"]
    episode = Episode("purr", ArmPlan(make_arms(["none"], DEFAULT_POLICY)[0], False), 0)
    result = run_episode(episode, task, config, factory_into({}, Unreachable))
    assert (result.stop_reason, result.resolved, result.steps) == ("error", False, 0)
    assert result.error is not None and "APIConnectionError" in result.error


def test_missing_data_names_the_setup_script(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"setup_env\.sh"):
        load_tasks(["purr"], tmp_path)
