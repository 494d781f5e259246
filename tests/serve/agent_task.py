"""The scripted agent task both framework adapters run (LangChain, OpenAI Agents SDK): the
task, the tool's file contents, and what a run under ``POLICY`` must show in its records."""

from __future__ import annotations

from leyline.policies import CallRecord

TASK = "Why is the order total wrong? Read the files, then answer."
FILES = 5  # scripted tool calls; the sixth call is the model's own answer
POLICY = "truncate:keep_last=2"


def output(path: str) -> str:
    lines = [f"{i:>3} | total = price * quantity - discount_{path}_{i}" for i in range(12)]
    return f"{path}\n" + "\n".join(lines)


def check_splices(records: list[CallRecord]) -> None:
    assert len(records) == FILES + 1, records
    assert len({r.session for r in records}) == 1, "one run, one session"
    assert all(r.leyline and r.resync is None and r.plan_fallback is None for r in records)
    edited = [r for r in records if r.cleared_tool_uses]
    assert all(r.path == "splice" and "splice" in r.verbs for r in edited), edited
    cleared = [u for r in edited for u in r.cleared_tool_uses]
    assert cleared == [f"call_{n}" for n in range(1, FILES - 1)], cleared  # keep_last=2


def check_plain_prefills_more(spliced: list[CallRecord], plain: list[CallRecord]) -> None:
    """The same edits sent as plain messages (no directives) prefill more after turn 1."""
    assert all(not r.verbs for r in plain)
    assert sum(r.prefilled_tokens or 0 for r in spliced[1:]) < sum(
        r.prefilled_tokens or 0 for r in plain[1:]
    )


def check_shrinks(records: list[CallRecord], baseline: list[CallRecord]) -> None:
    """The final prompt: the policy's stubs against the full tool outputs."""
    assert records[-1].prompt_tokens is not None and baseline[-1].prompt_tokens is not None
    assert records[-1].prompt_tokens < baseline[-1].prompt_tokens
