"""The OpenAI wire format the server speaks, plus the ``leyline`` extension on both sides.

Unknown OpenAI fields are ignored (clients send many we do not use); the ``leyline`` object
is validated strictly. Only what the engine honours is modelled.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from leyline.protocol import LeylineRequest, LeylineResponse
from leyline.protocol.resources import CacheSalt, Message
from leyline.protocol.validation import error_from_details

Role = Literal["system", "developer", "user", "assistant", "tool"]
FinishReason = Literal["stop", "length", "tool_calls", "cancelled"]


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TextPart(_Lenient):
    type: Literal["text"] = "text"
    text: str


class FunctionCall(_Lenient):
    name: str
    arguments: str = Field(description="JSON-encoded arguments, as OpenAI sends them.")


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Lenient):
    role: Role
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(_Lenient):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, object] | None = None


class ToolSpec(_Lenient):
    type: Literal["function"] = "function"
    function: FunctionSpec


class NamedToolChoice(_Lenient):
    type: Literal["function"] = "function"
    function: dict[str, str]


class StreamOptions(_Lenient):
    include_usage: bool = False


class SamplingFields(_Lenient):
    """Fields shared by chat and text completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(
        default=None, ge=-(2**63), le=2**64 - 1, description="Any 64-bit seed, signed or not."
    )
    cache_salt: CacheSalt | None = Field(
        default=None,
        description="Partitions the shared prefix cache further inside the caller's tenant "
        "(as vLLM's cache_salt): only requests with the same salt share cached KV. For a "
        "session, the salt of the request that created it holds for its lifetime.",
    )
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Literal[1] = 1
    leyline: LeylineRequest | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def token_budget(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class CompletionRequest(SamplingFields):
    prompt: Annotated[str | list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False


# ---- responses -----------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


class TopLogprob(_Strict):
    token: str
    logprob: float
    bytes: list[int] | None = None
    """The token's own bytes (exact for a part of a multi-byte character)."""
    token_id: int | None = None
    """Leyline extension: the token's id, so a client can compare without re-tokenizing."""


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(_Strict):
    content: list[TokenLogprob] | None = None


class AssistantMessage(_Strict):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(_Strict):
    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None = None


class PromptTokensDetails(_Strict):
    cached_tokens: int
    """Prompt tokens whose KV was reused rather than computed (OpenAI's field)."""


class Usage(_Strict):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ChatCompletion(_Strict):
    id: str = Field(default_factory=lambda: new_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    leyline: LeylineResponse | None = None


class ChunkDelta(_Strict):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, object]] | None = None


class ChunkChoice(_Strict):
    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Strict):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    leyline: LeylineResponse | None = None


class CompletionLogprobs(_Strict):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Strict):
    index: int = 0
    text: str
    finish_reason: FinishReason | None
    logprobs: CompletionLogprobs | None = None


class Completion(_Strict):
    id: str = Field(default_factory=lambda: new_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    leyline: LeylineResponse | None = None


class ModelCard(_Strict):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "leyline"


class ModelList(_Strict):
    object: Literal["list"] = "list"
    data: list[ModelCard]


_MESSAGES = TypeAdapter(list[ChatMessage])
_TOOLS = TypeAdapter(list[ToolSpec])


def parse_chat(
    messages: Sequence[Message], tools: Sequence[Message] | None = None
) -> tuple[list[ChatMessage], list[ToolSpec]]:
    """Messages and tool specs sent as plain JSON (session create, tokenize), checked with
    the same models as a chat request; a problem is a typed error naming its full path."""
    parsed: list[object] = []
    for adapter, raw, field in ((_MESSAGES, messages, "messages"), (_TOOLS, tools or [], "tools")):
        try:
            parsed.append(adapter.validate_python(list(raw)))
        except ValidationError as exc:
            raise error_from_details(exc.errors(include_url=False), field) from None
    return parsed[0], parsed[1]  # type: ignore[return-value]
