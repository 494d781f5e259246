"""The SDK unchanged against the live backend: ``LeylineOpenAI`` wraps an ordinary OpenAI
client, finds the server speaks Leyline, and turns a truncation policy's edits into splice
directives on one session. Every call is answered as asked (no fallback), the edits are
spliced with their downstream KV kept, and the session ends holding exactly the
conversation the client holds, as the server renders it."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai

from leyline.evals.mechanism.synthetic import synthetic_trajectory
from leyline.policies import LeylineOpenAI
from leyline.protocol.resources import Routes

from ._live import record

TURNS = 5


def test_a_truncation_policy_runs_as_splices_through_the_sdk(
    server: httpx.Client, url: str, report_path: Path | None
) -> None:
    base = openai.OpenAI(base_url=url + "/v1", api_key="none")
    client = LeylineOpenAI(base, "truncate:keep_last=2")
    trajectory = synthetic_trajectory(7, seed=5, turns=TURNS)
    messages = trajectory.opening()
    for turn in range(1, TURNS + 1):
        messages += trajectory.turn(turn)
        reply = client.chat.completions.create(
            model="default", messages=messages, tools=trajectory.tool_specs(), max_tokens=1,
            temperature=0,
        )  # fmt: skip
        assert reply.choices, reply
    assert client.probe().leyline
    records = client.records
    spliced = [r for r in records if r.directives and r.path == "splice"]
    record(
        report_path, check="SDK: truncate:keep_last=2 as splices", calls=len(records),
        splices=len(spliced), rotated=sum(r.rotated_tokens or 0 for r in spliced),
    )  # fmt: skip
    assert all(r.leyline and r.fallback_reason is None for r in records), records
    assert spliced and all((r.rotated_tokens or 0) > 0 for r in spliced), records
    session = records[-1].session
    assert session is not None and len({r.session for r in records}) == 1
    held = server.get(Routes.session.format(session=session), params={"tokens": "true"}).json()
    tools = trajectory.tool_specs()
    plan = client.episode.last_plan
    assert plan is not None
    sent = [dict(m) for m in plan.messages]  # the transcript as sent, edits applied
    rendered = server.post(
        Routes.tokenize, json={"messages": sent, "tools": tools, "add_generation_prompt": True}
    ).json()["tokens"]
    text = server.post(Routes.detokenize, json={"tokens": held["tokens"]}).json()["text"]
    prompt = server.post(Routes.detokenize, json={"tokens": rendered}).json()["text"]
    assert text.startswith(prompt), (text[-300:], prompt[-300:])
    client.close()
