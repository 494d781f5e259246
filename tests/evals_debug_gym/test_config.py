"""Arms, run configuration, the server probe and the command line (no debug-gym needed)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from leyline.evals.debug_gym.cli import build_parser, config_from_args
from leyline.evals.debug_gym.config import TASK_NAMES, RunConfig, make_arms
from leyline.evals.debug_gym.server import plan_arm, probe_server, server_root
from leyline.policies import PolicyConfigError


def test_arms_share_the_policy_and_reject_bad_names() -> None:
    arms = make_arms(["none", "reprefill", "splice"], "truncate:keep_last=3")
    assert [(a.name, a.policy, a.splice) for a in arms] == [
        ("none", None, False),
        ("reprefill", "truncate:keep_last=3", False),
        ("splice", "truncate:keep_last=3", True),
    ]
    with pytest.raises(ValueError, match="unknown arm"):
        make_arms(["splcie"], "truncate")
    with pytest.raises(ValueError, match="twice"):
        make_arms(["none", "none"], "truncate")
    with pytest.raises(PolicyConfigError):
        make_arms(["none"], "truncate:keep_lats=2")


def test_run_config_rejects_unknown_tasks_and_the_listdir_tool() -> None:
    with pytest.raises(ValueError, match="unknown tasks"):
        RunConfig(tasks=("nightmare",))
    with pytest.raises(ValueError, match="listdir"):
        RunConfig(tools=("listdir", "eval"))
    with pytest.raises(ValueError, match="runs"):
        RunConfig(runs=0)


def test_cli_defaults_match_upstream_mini_nightmare_and_all_arms() -> None:
    config = config_from_args(build_parser().parse_args(["--out", "x"]))
    assert config.tasks == TASK_NAMES and config.runs == 3 and config.max_steps == 50
    assert [a.name for a in config.arms] == ["none", "reprefill", "splice"]
    assert config.tools == ("bash", "view", "pdb", "edit", "eval", "submit")
    assert config.out == Path("x") and not config.scripted
    args = ["--tasks", "purr, sum_tree", "--arms", "splice", "--policy", "stale", "--scripted"]
    config = config_from_args(build_parser().parse_args(args))
    assert config.tasks == ("purr", "sum_tree") and config.arms[0].policy == "stale"
    assert config.out.name.endswith("-scripted")


def test_help_runs_without_debug_gym_imported() -> None:
    code = (
        "import sys, runpy; sys.argv = ['x', '--help']\n"
        "try:\n    runpy.run_module('leyline.evals.debug_gym', run_name='__main__')\n"
        "except SystemExit: pass\n"
        "assert 'debug_gym' not in sys.modules, 'debug_gym imported by --help'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "--base-url" in done.stdout and "--scripted" in done.stdout


def mock_server(capabilities: dict[str, object] | None, status: int = 200) -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "smollm2"}]})
        if request.url.path == "/leyline/v1/capabilities" and capabilities is not None:
            return httpx.Response(status, json=capabilities)
        return httpx.Response(404, json={"detail": "Not Found"})

    return httpx.MockTransport(handle)


def test_probe_finds_a_leyline_server_and_plans_the_splice_arm_on_it() -> None:
    caps = {"protocol_version": "1.0", "verbs": ["splice", "forget"]}
    info = probe_server("http://h:8000/v1", "k", transport=mock_server(caps))
    assert info.leyline and info.models == ("smollm2",) and "splice, forget" in info.note
    plan = plan_arm(make_arms(["splice"], "truncate")[0], info)
    assert plan.directives and plan.degraded is None


@pytest.mark.parametrize(
    ("caps", "why"),
    [
        (None, "no Leyline capabilities"),
        ({"protocol_version": "2.0", "verbs": ["splice"]}, "incompatible"),
        ({"protocol_version": "1.0", "verbs": ["forget"]}, "without the splice verb"),
    ],
)
def test_probe_degrades_the_splice_arm_on_other_servers(
    caps: dict[str, object] | None, why: str
) -> None:
    info = probe_server("http://h:8000/v1", None, transport=mock_server(caps))
    assert not info.leyline and why in info.note
    plan = plan_arm(make_arms(["splice"], "truncate")[0], info)
    assert not plan.directives and plan.degraded == info.note
    assert "DEGRADED" in plan.transport


def test_server_root_strips_the_openai_prefix() -> None:
    assert server_root("http://h:8000/v1/") == "http://h:8000"
    assert server_root("http://h:8000") == "http://h:8000"
