"""A TOY stand-in for a Leyline server, on the toy rendering of ``toy_chat``, for tests only.

It does what the spec asks of a server with a plan: resolve the batch against the cached
revision (``resolve_batch``), apply it (``apply_edits``), and check that the request's
messages render to the edited tokens plus an appended tail, which is what lets the server
keep the KV. It generates nothing: the scripted agent appends its own replies. It accepts
the retention verbs (pin, decay, scratch) and keeps no marks: tests script the drops.
"""

from __future__ import annotations

from leyline.policies import TurnPlan
from leyline.protocol import (
    ForgetDirective,
    LeylineResponse,
    Path,
    Verb,
    apply_edits,
    resolve_batch,
)

from .toy_chat import render, tokenize


class ToyServer:
    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.spans: list[object] = []
        self.revision = 0
        self.batches: list[TurnPlan] = []

    def chat(self, plan: TurnPlan) -> LeylineResponse:
        target = render(plan.messages)
        reused, rotated, path = 0, 0, Path.prefix_hit
        if plan.directives:
            assert plan.base_revision == self.revision, "the plan addresses a stale revision"
            batch = resolve_batch(
                plan.directives,
                length=len(self.tokens),
                tokenize=tokenize,
                spans=self.spans,  # type: ignore[arg-type]
                supported=frozenset(Verb),
            )
            result = apply_edits(self.tokens, batch.edits)
            edited = list(result.tokens)
            assert target.tokens[: len(edited)] == edited, "request is not edited cache + tail"
            reused, rotated = result.reused_tokens, result.rotated_tokens
            forget = any(isinstance(d, ForgetDirective) for d in plan.directives)
            path = Path.reprefill if forget else Path.splice
            self.batches.append(plan)
        else:
            while reused < min(len(self.tokens), len(target.tokens)) and (
                self.tokens[reused] == target.tokens[reused]
            ):
                reused += 1
            path = Path.prefix_hit if reused == len(self.tokens) else Path.reprefill
        self.tokens, self.spans = target.tokens, list(target.spans)
        self.revision += 1
        return LeylineResponse(
            revision=self.revision,
            path=path,
            reused_tokens=reused,
            prefilled_tokens=len(self.tokens) - reused,
            rotated_tokens=rotated,
            spans=target.spans,
        )
