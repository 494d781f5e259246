"""Combinators: ``chain`` runs policies in order, ``when`` runs one under a condition."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field, model_validator

from .base import Policy, PolicyContext, check_result
from .edits import (
    KeepServed,
    PolicyEdit,
    ReplaceContent,
    ReplaceMessage,
    apply_to_messages,
    readdress,
    touched,
)
from .registry import PolicyField
from .transcript import Transcript


class Chain(Policy):
    """Run ``policies`` in order, each on the transcript as the previous ones left it.

    Edits come back addressed to the original transcript. A later edit of a message that an
    earlier policy replaced wins; a later policy may not edit a note an earlier one appended.
    """

    type: Literal["chain"] = "chain"
    policies: tuple[PolicyField, ...] = Field(min_length=1)

    def stub_templates(self) -> tuple[str, ...]:
        return tuple(t for p in self.policies for t in p.stub_templates())

    def pins(self, transcript: Transcript) -> frozenset[int]:
        return frozenset().union(*(p.pins(transcript) for p in self.policies))

    def pin_ttl_s(self) -> float | None:
        ttls = [t for p in self.policies if (t := p.pin_ttl_s()) is not None]
        return max(ttls) if ttls else None

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        edits: list[PolicyEdit] = []
        current = transcript
        source: Sequence[int | None] = range(len(transcript))
        for policy in self.policies:
            proposed = policy.propose(current, context)
            check_result(policy.type, current, proposed)
            if not proposed:
                continue
            mapped = [readdress(e, source, policy.type) for e in proposed]
            later = {i for e in mapped for i in touched(e)}
            edits = [
                e
                for e in edits
                if not (
                    isinstance(e, ReplaceContent | ReplaceMessage | KeepServed)
                    and e.message in later
                )
            ] + mapped
            applied = apply_to_messages(transcript.messages, edits)
            pinned = [j for j, s in enumerate(applied.source) if s in transcript.pinned]
            current = Transcript.from_messages(applied.messages, pinned=pinned)
            source = applied.source
        return edits


class When(Policy):
    """Run ``policy`` only while every given condition holds (at least one is required)."""

    type: Literal["when"] = "when"
    policy: PolicyField
    min_tokens: int | None = Field(default=None, ge=0)
    min_turns: int | None = Field(default=None, ge=0)
    min_messages: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _has_condition(self) -> When:
        if self.min_tokens is None and self.min_turns is None and self.min_messages is None:
            raise ValueError("give at least one condition: min_tokens, min_turns, min_messages")
        return self

    def stub_templates(self) -> tuple[str, ...]:
        return self.policy.stub_templates()

    def pins(self, transcript: Transcript) -> frozenset[int]:
        return self.policy.pins(transcript)  # pins hold whether or not the condition does

    def pin_ttl_s(self) -> float | None:
        return self.policy.pin_ttl_s()

    def holds(self, transcript: Transcript, context: PolicyContext) -> bool:
        if self.min_turns is not None and transcript.num_turns < self.min_turns:
            return False
        if self.min_messages is not None and len(transcript) < self.min_messages:
            return False
        if self.min_tokens is not None:
            total = sum(context.tokens(m) for m in transcript.messages)
            if total < self.min_tokens:
                return False
        return True

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return self.policy.propose(transcript, context) if self.holds(transcript, context) else []
