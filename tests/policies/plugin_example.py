"""A third-party policy, as a package would ship it behind a ``leyline.policies`` entry point."""

from __future__ import annotations

from typing import Literal

from leyline.policies import Policy, PolicyContext, PolicyEdit, ReplaceContent, Transcript


class ShoutingStub(Policy):
    """Stubs every tool output with an upper-case note (a toy, for the registry tests)."""

    type: Literal["shout"] = "shout"
    word: str = "GONE"

    def stub_templates(self) -> tuple[str, ...]:
        return (f"[{self.word}]",)

    def propose(self, transcript: Transcript, context: PolicyContext) -> list[PolicyEdit]:
        return [
            ReplaceContent(o.message, f"[{self.word}]")
            for o in transcript.outputs
            if not context.is_stub(o.text)
        ]


class Misnamed(ShoutingStub):
    type: Literal["not-the-entry-name"] = "not-the-entry-name"  # type: ignore[assignment]
