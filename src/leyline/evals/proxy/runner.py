"""One task in every arm, through ``LeylineOpenAI`` against an OpenAI-compatible server.

Each arm replays the same agent episode turn by turn (one greedy token per request, then the
next scripted call), so the server caches each turn before the policy edits it; the last
request adds the question. Arms: ``none`` (append-only), ``reprefill``
(``TruncateOldToolOutputs`` as plain edited messages), ``splice`` (the same edits as splice
directives; re-prefill where the server has no Leyline, and the report says so) and, with
``RunSettings.summarize``, ``summarize``.

Scoring (``scoring``): on Leyline, one ``/v1/completions`` request in the arm's session on
its cached tokens plus an answer prefix (the chat route cannot start the assistant's reply);
elsewhere the first token of the chat reply. See docs/reports/eval-proxy.md.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import openai

from leyline.evals.demo.agreement import approx_kl, first_token_top
from leyline.policies import CallRecord, LeylineOpenAI, Policy, TruncateOldToolOutputs
from leyline.policies.summarize import Summarize
from leyline.policies.triggers import Trigger
from leyline.protocol.client import LeylineClient

from .scoring import Choice, choose
from .tasks import Task

ARMS: tuple[str, ...] = ("none", "reprefill", "splice")
POLICY_ARMS: tuple[str, ...] = ("reprefill", "splice")
SUMMARIZE_ARM = "summarize"
SUMMARIZE_AFTER = 3
"""Tool uses in the history before the summarize arm's policy fires."""
SUMMARY_TOKENS = 64
OnCall = Callable[[str, CallRecord], None]


@dataclass(frozen=True, slots=True)
class RunSettings:
    model: str
    keep_last: int = 2
    top_logprobs: int = 20
    session_prefix: str = "proxy"
    summarize: bool = False
    """Also run the ``summarize`` arm."""

    @property
    def arms(self) -> tuple[str, ...]:
        return (*ARMS, SUMMARIZE_ARM) if self.summarize else ARMS


@dataclass(frozen=True, slots=True)
class ScoreCall:
    """The request that scored the answer: how, and what the server did for it."""

    method: str
    """``answer-prefix`` (completions in the session) or ``chat-first-token``."""
    path: str | None = None
    prefilled: int | None = None
    reused: int | None = None
    prompt_digest: str | None = None
    """SHA-256 of the cached prompt tokens that were scored (None: chat scoring)."""


@dataclass(frozen=True, slots=True)
class ArmResult:
    """One arm on one task: its scored choice and what the server did per request."""

    choice: Choice
    top: list[tuple[str, float]] = field(repr=False)
    records: list[CallRecord] = field(repr=False)
    """The agent's requests (the middleware's records); the scoring request is ``score``."""
    score: ScoreCall

    def total(self, name: str) -> int:
        """Sum of a token count (``prefilled_tokens``, ...) over the agent's requests."""
        return sum(getattr(r, name) or 0 for r in self.records)

    def paths(self) -> list[str | None]:
        return [r.path for r in self.records]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.choice.to_json(),
            "prefilled": self.total("prefilled_tokens"),
            "reused": self.total("reused_tokens"),
            "rotated": self.total("rotated_tokens"),
            "paths": self.paths(),
            "leyline": all(r.leyline for r in self.records),
            "resyncs": [r.resync for r in self.records if r.resync],
            "fallbacks": [r.fallback_reason for r in self.records if r.fallback_reason],
            "score_call": {
                "method": self.score.method,
                "path": self.score.path,
                "prefilled": self.score.prefilled,
                "reused": self.score.reused,
                "prompt_digest": self.score.prompt_digest,
            },
            "first_token_top": [[t, lp] for t, lp in self.top],
        }


@dataclass(frozen=True, slots=True)
class TaskResult:
    task: Task
    arms: dict[str, ArmResult]

    @property
    def choices_agree(self) -> bool:
        """The splice and re-prefill arms chose the same candidate."""
        return self.arms["splice"].choice.choice == self.arms["reprefill"].choice.choice

    @property
    def same_tokens(self) -> bool | None:
        """Both policy arms scored the same cached tokens (None: not known, chat scoring)."""
        a, b = (self.arms[name].score.prompt_digest for name in POLICY_ARMS)
        return None if a is None or b is None else a == b

    @property
    def kl(self) -> float | None:
        """KL(re-prefill || splice) of the answer token, over the re-prefill arm's top-k."""
        return approx_kl(self.arms["reprefill"].top, self.arms["splice"].top)

    def to_json(self) -> dict[str, Any]:
        return {
            **self.task.to_json(),
            "choices_agree": self.choices_agree,
            "same_tokens": self.same_tokens,
            "kl": self.kl,
            "arms": {name: arm.to_json() for name, arm in self.arms.items()},
        }


class ProxyRunner:
    """Runs tasks against one server. ``leyline``: the server speaks Leyline (probed)."""

    def __init__(
        self,
        client: openai.OpenAI,
        settings: RunSettings,
        *,
        leyline: LeylineClient | None,
        on_call: OnCall | None = None,
    ) -> None:
        self.client, self.settings, self.leyline, self.on_call = client, settings, leyline, on_call

    def run(self, task: Task) -> TaskResult:
        # Alternate the arm order per task so that no arm always runs on a warmer machine.
        arms = self.settings.arms
        order = arms if task.index % 2 == 0 else arms[::-1]
        prefix = self._prefix_tokens(task)
        done = {name: self._arm(task, name, prefix) for name in order}
        return TaskResult(task, {name: done[name] for name in arms})

    def _prefix_tokens(self, task: Task) -> list[int] | None:
        if self.leyline is None:
            return None
        return list(self.leyline.tokenize(task.answer_prefix).tokens)

    def _arm(self, task: Task, arm: str, prefix: list[int] | None) -> ArmResult:
        settings = self.settings
        policy: Policy | None = None
        if arm in POLICY_ARMS:
            policy = TruncateOldToolOutputs(keep_last=settings.keep_last)
        elif arm == SUMMARIZE_ARM:
            policy = Summarize(
                trigger=Trigger(tool_uses=SUMMARIZE_AFTER),
                keep_last=settings.keep_last,
                max_tokens=SUMMARY_TOKENS,
            )
        wrapper = LeylineOpenAI(
            self.client,
            policy,
            session=f"{settings.session_prefix}-{task.index}-{arm}",
            directives=arm in ("splice", SUMMARIZE_ARM),
        )
        messages = task.opening()
        try:
            for turn in range(1, len(task.turns) + 1):
                messages += task.tool_turn(turn)
                self._ask(wrapper, arm, messages)
            messages.append(task.question_message())
            completion = self._ask(wrapper, arm, messages, settings.top_logprobs)
            if prefix is not None and wrapper.records[-1].leyline:
                top, score = self._score_in_session(wrapper, prefix)
            else:
                top, score = first_token_top(completion), ScoreCall("chat-first-token")
        finally:
            wrapper.close()
        choice = choose(top, task.candidates, task.answer)
        return ArmResult(choice, top, list(wrapper.records), score)

    def _ask(
        self,
        wrapper: LeylineOpenAI,
        arm: str,
        messages: list[dict[str, Any]],
        top_logprobs: int = 0,
    ) -> Any:
        """One greedy token (the agent's turn); with ``top_logprobs``, its top-k too.

        No tool list is sent: the calls are scripted, and the list would add ~100 prompt
        tokens to every arm (the calls in the history render the same without it).
        """
        scoring: dict[str, Any] = {}
        if top_logprobs:
            scoring = {"logprobs": True, "top_logprobs": top_logprobs}
        completion = wrapper.chat.completions.create(
            model=self.settings.model,
            messages=messages,
            max_tokens=1,
            temperature=0,
            **scoring,
        )
        if self.on_call is not None:
            self.on_call(arm, wrapper.records[-1])
        return completion

    def _score_in_session(
        self, wrapper: LeylineOpenAI, prefix: list[int]
    ) -> tuple[list[tuple[str, float]], ScoreCall]:
        """The next token's top-k after the answer prefix, on the arm's own cache."""
        assert self.leyline is not None
        record = wrapper.records[-1]
        info = self.leyline.get_session(wrapper.session, include_tokens=True)
        if record.prompt_tokens is None or info.tokens is None:
            raise RuntimeError(f"session {wrapper.session}: no prompt length or tokens reported")
        # The cache holds the prompt and the one generated token: drop the latter.
        prompt = list(info.tokens)[: record.prompt_tokens]
        completion = self.client.completions.create(
            model=self.settings.model,
            prompt=prompt + prefix,
            max_tokens=1,
            temperature=0,
            logprobs=self.settings.top_logprobs,
            extra_body={"leyline": {"session": wrapper.session}},
        )
        logprobs = completion.choices[0].logprobs
        top = dict(logprobs.top_logprobs[0]) if logprobs and logprobs.top_logprobs else {}
        report = (completion.model_extra or {}).get("leyline") or {}
        score = ScoreCall(
            "answer-prefix",
            report.get("path"),
            report.get("prefilled_tokens"),
            report.get("reused_tokens"),
            hashlib.sha256(json.dumps(prompt).encode()).hexdigest(),
        )
        return sorted(top.items(), key=lambda item: -item[1]), score
