"""`leyline eval proxy`: task generation, candidate scoring, and a short end-to-end run."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from leyline.evals.proxy.scoring import choose
from leyline.evals.proxy.summary import ARMS, summarize
from leyline.evals.proxy.tasks import FAMILIES, WAIT_TOOL, Task, make_task, make_tasks
from leyline.policies import TruncateOldToolOutputs, apply_to_messages, run_policy
from tests.meta.fresh_python import eval_cli_loads

TASKS = [make_task(seed, i, stale) for seed in (0, 7) for i in range(8) for stale in (1, 2, 5)]


def full_history(task: Task) -> list[dict[str, object]]:
    messages = task.opening()
    for turn in range(1, len(task.turns) + 1):
        messages += task.tool_turn(turn)
    return [*messages, task.question_message()]


def shows(word: str, text: object) -> bool:
    return re.search(rf"\b{re.escape(word)}\b", str(text)) is not None


def test_tasks_are_deterministic_in_the_seed() -> None:
    assert make_tasks(3, 6, (1, 4)) == make_tasks(3, 6, (1, 4))
    assert make_tasks(3, 6, (1, 4)) != make_tasks(4, 6, (1, 4))
    assert [t.stale for t in make_tasks(0, 5, (1, 4))] == [1, 4, 1, 4, 1]
    assert {t.family for t in make_tasks(0, 8, (2,))} == {f.name for f in FAMILIES}
    with pytest.raises(ValueError):
        make_task(0, 0, 0)


@pytest.mark.parametrize("task", TASKS, ids=lambda t: f"{t.family}-{t.index}-{t.stale}")
def test_the_answer_is_in_the_last_poll_only(task: Task) -> None:
    polls, waits = task.polls, task.turns[1::2]
    assert len(polls) == task.stale + 1 and len(waits) == task.stale
    assert {t.tool for t in waits} == {WAIT_TOOL} and WAIT_TOOL not in {t.tool for t in polls}
    assert shows(task.answer, polls[-1].output)
    assert task.answer not in task.distractors and task.distractors
    assert set(task.candidates) == {task.answer, *task.distractors}
    for value, poll in zip(task.values, polls, strict=True):
        # Each poll shows its own value and no other candidate.
        assert [c for c in task.candidates if shows(c, poll.output)] == [value]
    others = [t.output for t in waits] + [m["content"] for m in task.opening()]
    assert not any(shows(c, text) for c in task.candidates for text in [*others, task.question])
    if task.mode == "repeat":
        assert len(task.distractors) == 1


@pytest.mark.parametrize("task", TASKS[::5], ids=lambda t: f"{t.family}-{t.index}-{t.stale}")
def test_keep_last_2_stubs_every_distractor_and_keeps_the_answer(task: Task) -> None:
    messages = full_history(task)
    edits = run_policy(TruncateOldToolOutputs(keep_last=2), messages)
    edited = apply_to_messages(messages, edits).messages
    assert len(edits) >= task.stale  # every stale poll (and old waits) stubbed
    text = " ".join(str(m.get("content")) for m in edited)
    assert shows(task.answer, text)
    assert not any(shows(d, text) for d in task.distractors)
    unedited = " ".join(str(m.get("content")) for m in messages)
    assert all(shows(d, unedited) for d in task.distractors)


def test_choice_merges_case_and_attributes_unique_prefixes() -> None:
    top = [(" the", -0.5), (" gold", -1.0), (" Gold", -2.0), (" Re", -2.5), (" now", -3.0)]
    made = choose(top, ["Gold", "Red"], answer="Red")
    assert made.choice == "Gold" and not made.correct and made.top1 == " the"
    assert made.scores["Gold"] == pytest.approx(math.log(math.exp(-1.0) + math.exp(-2.0)))
    assert made.scores["Red"] == -2.5 and made.margin == pytest.approx(-2.5 - made.scores["Gold"])
    # A prefix of two candidates names neither; no candidate in the top-k: unscored, wrong.
    assert choose([("R", -0.1)], ["Red", "Rome"], "Rome").scores == {}
    unscored = choose([(" the", -0.1)], ["Red", "Rome"], "Rome")
    assert unscored.choice is None and not unscored.correct and unscored.margin is None
    with pytest.raises(ValueError):
        choose(top, ["Gold"], answer="Red")


def test_cli_imports_no_torch_and_rejects_bad_levels() -> None:
    assert "torch" not in eval_cli_loads("proxy")
    bad = subprocess.run(
        [sys.executable, "-m", "leyline.cli.main", "eval", "proxy", "--stale", "0,2"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "stale levels must be >= 1" in bad.stderr


def test_against_a_server_without_leyline_the_splice_arm_degrades_and_says_so(
    tmp_path: Path,
) -> None:
    from leyline.evals.proxy.run import ProxyOptions, run_proxy
    from tests.policies.plain_server import plain_server

    with plain_server() as server:  # a stand-in for any OpenAI server: canned replies
        options = ProxyOptions(
            tasks=1, stale=(2,), base_url=server.base_url, out=tmp_path, progress=False
        )
        data = run_proxy(options)
    assert all("leyline" not in body for body in server.requests)
    assert not any("/leyline/v1/sessions" in p for p in server.paths)
    arms = data["tasks"][0]["arms"]
    assert {a["score_call"]["method"] for a in arms.values()} == {"chat-first-token"}
    assert not arms["splice"]["leyline"] and arms["splice"]["choice"] is None  # no logprobs
    assert "DEGRADED to re-prefill" in (tmp_path / "report.md").read_text()
    assert data["summary"]["arms"]["splice"]["unscored"] == 1


@pytest.mark.slow
@pytest.mark.model
def test_end_to_end_on_the_embedded_server(tmp_path: Path) -> None:
    from leyline.evals.proxy.run import ProxyOptions, run_proxy

    data = run_proxy(ProxyOptions(tasks=2, stale=(2,), out=tmp_path, progress=False))
    on_disk = json.loads((tmp_path / "report.json").read_text())
    assert (tmp_path / "report.md").read_text().count("policy, splice") >= 2
    assert (tmp_path / "proxy.png").stat().st_size > 10_000
    records, summary = on_disk["tasks"], on_disk["summary"]
    assert len(records) == 2 and summary == data["summary"] == summarize(records)

    for record in records:
        arms = record["arms"]
        # The splice arm ran as splices on the server (not degraded, no resync, no
        # fallback); the other arms never did.
        assert "splice" in arms["splice"]["paths"] and arms["splice"]["leyline"]
        assert not arms["splice"]["resyncs"] and not arms["splice"]["fallbacks"]
        assert "splice" not in arms["reprefill"]["paths"] + arms["none"]["paths"]
        assert arms["splice"]["rotated"] > 0 and arms["reprefill"]["rotated"] == 0
        assert arms["splice"]["prefilled"] < arms["reprefill"]["prefilled"]
        # Both policy arms scored the same tokens (only their KV differs).
        assert record["same_tokens"] is True
        assert {a["score_call"]["method"] for a in arms.values()} == {"answer-prefix"}
        assert record["choices_agree"] == (arms["splice"]["choice"] == arms["reprefill"]["choice"])
        for arm in arms.values():
            assert arm["correct"] == (arm["choice"] == record["answer"])
            assert arm["choice"] is None or arm["choice"] in record["candidates"]

    for arm in ARMS:
        facts = summary["arms"][arm]
        assert facts["accuracy"]["successes"] == sum(r["arms"][arm]["correct"] for r in records)
        assert facts["prefilled"] == sum(r["arms"][arm]["prefilled"] for r in records)
    assert summary["arms"]["splice"]["paths"]["splice"] == sum(
        r["arms"]["splice"]["paths"].count("splice") for r in records
    )
    assert summary["agreement"]["same_choice"]["successes"] == sum(
        r["choices_agree"] for r in records
    )
