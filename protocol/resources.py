"""Bodies of the ``/leyline/v1/...`` resources (sessions, directives, tokenize, schema)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from .directives import Directive
from .envelope import RequestOptions
from .spans import MessageSpan, TokenId

API_PREFIX = "/leyline/v1"

Message = dict[str, JsonValue]
"""An OpenAI-format chat message (role, content, tool_calls, tool_call_id, name)."""


class Routes:
    """Paths of the Leyline resources; ``{session}`` is the session id."""

    capabilities = f"{API_PREFIX}/capabilities"
    sessions = f"{API_PREFIX}/sessions"
    session = f"{API_PREFIX}/sessions/{{session}}"
    directives = f"{API_PREFIX}/sessions/{{session}}/directives"
    tokenize = f"{API_PREFIX}/tokenize"
    detokenize = f"{API_PREFIX}/detokenize"
    schema = f"{API_PREFIX}/schema"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SessionCreate(_Body):
    """Create a session, optionally prefilled from messages, text or token ids (one of them)."""

    session: str | None = Field(default=None, min_length=1, max_length=128)
    messages: list[Message] | None = None
    text: str | None = None
    tokens: list[TokenId] | None = None
    add_generation_prompt: bool = Field(
        default=False,
        description="With messages: end with the template's assistant header, as a chat "
        "request renders its prompt (then a chat with the same messages reuses every token). "
        "Default false: the messages alone, ready to be extended with more messages.",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SessionCreate:
        given = [n for n in ("messages", "text", "tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of messages, text, tokens (got {given})")
        if self.add_generation_prompt and self.messages is None:
            raise ValueError("add_generation_prompt needs messages")
        return self


class SessionInfo(_Body):
    session: str
    revision: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    tokens: list[TokenId] | None = Field(default=None, description="With ?tokens=true.")
    spans: list[MessageSpan] = Field(default_factory=list)


class ApplyDirectives(_Body):
    """Apply a batch to a session without generating."""

    base_revision: int = Field(ge=0)
    directives: list[Directive] = Field(min_length=1)
    options: RequestOptions = Field(default_factory=RequestOptions)


class TokenizeRequest(_Body):
    """Tokenize text, or messages through the server's chat template (one of them)."""

    text: str | None = None
    messages: list[Message] | None = None
    tools: list[Message] | None = Field(
        default=None, description="OpenAI tool specs, rendered as a chat request would be."
    )
    add_generation_prompt: bool = False

    @model_validator(mode="after")
    def _exactly_one(self) -> TokenizeRequest:
        if (self.text is None) == (self.messages is None):
            raise ValueError("give exactly one of text, messages")
        return self


class TokenizeResponse(_Body):
    tokens: list[TokenId]
    spans: list[MessageSpan] = Field(default_factory=list)


class DetokenizeRequest(_Body):
    tokens: list[TokenId]


class DetokenizeResponse(_Body):
    text: str
