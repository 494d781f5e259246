"""One tool-using episode, run in two arms turn by turn over the same scripted decisions.

Both arms wrap the same OpenAI client with :class:`~leyline.policies.LeylineOpenAI` and
the same policy (TruncateOldToolOutputs). The splice arm sends the policy's edits as
Leyline directives; the re-prefill arm sends the same edited messages without directives,
so the server re-prefills from the first change (in its own session, reusing the prefix
before the change). Each turn the model generates after the newest tool output in both
arms; its reply is scored and then replaced by the next scripted call.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from leyline.evals.common.report import json_fields
from leyline.policies import (
    CallRecord,
    LeylineOpenAI,
    ReplaceContent,
    TruncateOldToolOutputs,
)

from .agreement import TopLogprobs, approx_kl, first_token_top, top1_agrees
from .script import SCRIPT, opening, tool_turn
from .tools import TOOL_SPECS, ProjectTools

ARMS = ("splice", "reprefill")


@dataclass(frozen=True, slots=True)
class EpisodeSettings:
    turns: int = 12
    keep_last: int = 2
    max_tokens: int = 8
    top_logprobs: int = 20
    model: str = ""
    """The model name sent in requests; "" = the embedded SmolLM2 / the endpoint's first."""

    def __post_init__(self) -> None:
        if not 1 <= self.turns <= len(SCRIPT):
            raise ValueError(f"turns must be in 1..{len(SCRIPT)}, got {self.turns}")
        if self.keep_last < 0 or self.max_tokens < 1 or not 0 <= self.top_logprobs <= 20:
            raise ValueError("keep_last >= 0, max_tokens >= 1, top_logprobs in 0..20")


@dataclass(frozen=True, slots=True)
class ArmTurn:
    record: CallRecord
    text: str
    """The model's reply (generated, scored, then replaced by the next scripted call)."""
    top: TopLogprobs = field(repr=False)


@dataclass(frozen=True, slots=True)
class TurnResult:
    turn: int
    call: str
    """The scripted tool call of this turn."""
    output_chars: int
    edits: tuple[str, ...]
    """What the policy changed this turn, e.g. ``stub out#2`` (the output of turn 2)."""
    arms: dict[str, ArmTurn]
    top1_agree: bool | None
    kl: float | None

    @property
    def text_agree(self) -> bool:
        return self.arms["splice"].text == self.arms["reprefill"].text

    def to_json(self) -> dict[str, Any]:
        return json_fields(
            self, "turn", "call", "output_chars", "edits", "top1_agree", "kl", "text_agree",
            arms={
                name: {
                    "record": arm.record.to_json(),
                    "text": arm.text,
                    "first_token_top": [[t, lp] for t, lp in arm.top],
                }
                for name, arm in self.arms.items()
            },
        )  # fmt: skip


class TwoArmEpisode:
    """Runs the turns; ``on_call(arm, record)`` is called after each request (progress)."""

    def __init__(
        self,
        client: openai.OpenAI,
        settings: EpisodeSettings,
        tools: ProjectTools,
        *,
        session_prefix: str,
        on_call: Callable[[str, CallRecord], None] | None = None,
    ) -> None:
        self.settings, self.tools, self.on_call = settings, tools, on_call
        policy = TruncateOldToolOutputs(keep_last=settings.keep_last)
        self.arms = {
            name: LeylineOpenAI(
                client, policy, session=f"{session_prefix}-{name}", directives=name == "splice"
            )
            for name in ARMS
        }
        self.messages: list[dict[str, Any]] = opening()

    def run(self) -> list[TurnResult]:
        try:
            return [self._turn(t) for t in range(1, self.settings.turns + 1)]
        finally:
            for arm in self.arms.values():
                arm.close()

    def _turn(self, turn: int) -> TurnResult:
        step = SCRIPT[turn - 1]
        self.messages += tool_turn(self.tools.run, turn)
        order = ARMS if turn % 2 else ARMS[::-1]  # alternate who goes first
        done = {name: self._ask(name) for name in order}
        reference, spliced = done["reprefill"].top, done["splice"].top
        return TurnResult(
            turn=turn,
            call=step.label(),
            output_chars=len(str(self.messages[-1]["content"])),
            edits=self._edits("splice"),
            arms={name: done[name] for name in ARMS},
            top1_agree=top1_agrees(reference, spliced),
            kl=approx_kl(reference, spliced),
        )

    def _ask(self, name: str) -> ArmTurn:
        arm = self.arms[name]
        scoring: dict[str, Any] = {}
        if self.settings.top_logprobs:
            scoring = {"logprobs": True, "top_logprobs": self.settings.top_logprobs}
        completion = arm.chat.completions.create(
            model=self.settings.model,
            messages=self.messages,
            tools=TOOL_SPECS,
            max_tokens=self.settings.max_tokens,
            temperature=0,
            **scoring,
        )
        record = arm.records[-1]
        if self.on_call is not None:
            self.on_call(name, record)
        message = completion.choices[0].message
        text = message.content or ""
        if message.tool_calls:
            text += " ".join(f"<tool_call {c.model_dump_json()}>" for c in message.tool_calls)
        return ArmTurn(record, text, first_token_top(completion))

    def _edits(self, name: str) -> tuple[str, ...]:
        plan = self.arms[name].episode.last_plan
        if plan is None:
            return ()
        return tuple(
            f"stub out#{(e.message - 1) // 2}"
            if isinstance(e, ReplaceContent)
            else type(e).__name__
            for e in plan.edits
        )
