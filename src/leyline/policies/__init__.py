"""Agent-side policies: transcript in, edits out; edits out, directives out.

No torch, no server: this package only needs pydantic (and the protocol package).

* :class:`Transcript` validates an OpenAI-format message list and links tool outputs to
  their calls.
* Policies (:class:`TruncateOldToolOutputs`, :class:`StaleToolOutputs`,
  :class:`FailedAttempts`, :class:`TokenBudget`, :class:`ClearToolUses`, :class:`Summarize`,
  :class:`FieldErrata`, :class:`Chain`, :class:`When`) propose message edits;
  :func:`parse_policy` builds them from a config string such as
  ``"stale | truncate:keep_last=2"``; :func:`run_policy` runs one.
* :func:`edits_to_directives` and :func:`infer_directives` (diff mode) turn edits into
  protocol directives; :class:`TurnPlanner` does both per turn for a middleware.
* :class:`LeylineOpenAI` / :class:`AsyncLeylineOpenAI` wrap an ``openai`` client for one
  agent episode: policy before each call, edits as directives, a :class:`CallRecord` per call,
  plain messages (re-prefilled) against servers without Leyline.
* :class:`SkillLibrary` / :class:`AsyncSkillLibrary` register skills (messages whose KV a
  server computes once); the wrappers compose a new skill message instead of prefilling it.
"""

from __future__ import annotations

from .align import align_messages
from .base import EditMode, Policy, PolicyContext, Summarizer, SummaryRequest, run_policy
from .budget import TokenBudget
from .clear import ClearToolUses
from .combinators import Chain, When
from .counting import (
    CallableCounter,
    EstimateCounter,
    TiktokenCounter,
    TokenCounter,
    default_counter,
    message_tokens,
)
from .edits import (
    AppendErratum,
    AppliedEdits,
    DropMessages,
    KeepServed,
    MarkSpan,
    PolicyEdit,
    ReplaceContent,
    ReplaceMessage,
    apply_to_messages,
)
from .errata import FieldErrata
from .errors import (
    PinnedSpanError,
    PolicyConfigError,
    PolicyEditError,
    PolicyError,
    SkillError,
    TranscriptError,
    UnknownPolicyError,
)
from .failed import FailedAttempts
from .messages import Message
from .middleware import LeylineOpenAI
from .middleware_async import AsyncLeylineOpenAI
from .middleware_core import CallRecord
from .middleware_wire import ServerSupport
from .planner import TurnPlan, TurnPlanner
from .registry import (
    ENTRY_POINT_GROUP,
    PolicyConfig,
    PolicyRegistry,
    default_registry,
    parse_policy,
    register_policy,
)
from .retention import Pin, ScratchReasoning
from .retention_marks import Dropped
from .skill_refs import SKILL_KEY, SkillBlock
from .skills import DEFAULT_SKILL_CONTEXT, AsyncSkillLibrary, SkillEntry, SkillLibrary, SkillSet
from .staleness import StaleToolOutputs
from .stubs import StubMatcher
from .summarize import Summarize
from .transcript import ToolCall, ToolOutput, Transcript
from .translate import (
    Addressing,
    DirectivePlan,
    Render,
    edits_to_directives,
    infer_directives,
    plan_directives,
)
from .triggers import Trigger
from .truncate import TruncateOldToolOutputs

__all__ = [
    "DEFAULT_SKILL_CONTEXT",
    "ENTRY_POINT_GROUP",
    "SKILL_KEY",
    "Addressing",
    "AppendErratum",
    "AppliedEdits",
    "AsyncLeylineOpenAI",
    "AsyncSkillLibrary",
    "CallRecord",
    "CallableCounter",
    "Chain",
    "ClearToolUses",
    "DirectivePlan",
    "DropMessages",
    "Dropped",
    "EditMode",
    "EstimateCounter",
    "FailedAttempts",
    "FieldErrata",
    "KeepServed",
    "LeylineOpenAI",
    "MarkSpan",
    "Message",
    "Pin",
    "PinnedSpanError",
    "Policy",
    "PolicyConfig",
    "PolicyConfigError",
    "PolicyContext",
    "PolicyEdit",
    "PolicyEditError",
    "PolicyError",
    "PolicyRegistry",
    "Render",
    "ReplaceContent",
    "ReplaceMessage",
    "ScratchReasoning",
    "ServerSupport",
    "SkillBlock",
    "SkillEntry",
    "SkillError",
    "SkillLibrary",
    "SkillSet",
    "StaleToolOutputs",
    "StubMatcher",
    "Summarize",
    "Summarizer",
    "SummaryRequest",
    "TiktokenCounter",
    "TokenBudget",
    "TokenCounter",
    "ToolCall",
    "ToolOutput",
    "Transcript",
    "TranscriptError",
    "Trigger",
    "TruncateOldToolOutputs",
    "TurnPlan",
    "TurnPlanner",
    "UnknownPolicyError",
    "When",
    "align_messages",
    "apply_to_messages",
    "default_counter",
    "default_registry",
    "edits_to_directives",
    "infer_directives",
    "message_tokens",
    "parse_policy",
    "plan_directives",
    "register_policy",
    "run_policy",
]
