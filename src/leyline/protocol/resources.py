"""Bodies of the ``/leyline/v1/...`` resources (sessions, directives, skills, tokenize, schema)."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue, StringConstraints, model_validator

from .directives import Directive
from .envelope import DroppedSpan, RequestOptions
from .spans import MessageSpan, TokenId

API_PREFIX = "/leyline/v1"

CacheSalt = Annotated[str, StringConstraints(min_length=1, max_length=256)]
"""A ``cache_salt``: narrows the caller's shared-cache partition (docs/protocol.md)."""

Message = dict[str, JsonValue]
"""An OpenAI-format chat message (role, content, tool_calls, tool_call_id, name)."""


class Routes:
    """Paths of the Leyline resources; ``{session}`` and ``{skill}`` are ids (URL-quoted)."""

    capabilities = f"{API_PREFIX}/capabilities"
    sessions = f"{API_PREFIX}/sessions"
    session = f"{API_PREFIX}/sessions/{{session}}"
    directives = f"{API_PREFIX}/sessions/{{session}}/directives"
    skills = f"{API_PREFIX}/skills"
    skill = f"{API_PREFIX}/skills/{{skill}}"
    tokenize = f"{API_PREFIX}/tokenize"
    detokenize = f"{API_PREFIX}/detokenize"
    schema = f"{API_PREFIX}/schema"


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Reply(BaseModel):
    # A response: a client ignores fields a newer minor version adds (docs/protocol.md, 9).
    model_config = ConfigDict(extra="ignore", frozen=True)


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
    cache_salt: CacheSalt | None = Field(
        default=None,
        description="Partitions the shared prefix cache further inside the caller's tenant "
        "(as a chat request's cache_salt): the session shares cached KV only with requests "
        "and sessions of its tenant with the same salt, for its lifetime. A server whose "
        "capabilities say cache_salt: false refuses it (422).",
    )

    @model_validator(mode="after")
    def _one_source(self) -> SessionCreate:
        given = [n for n in ("messages", "text", "tokens") if getattr(self, n) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one of messages, text, tokens (got {given})")
        if self.add_generation_prompt and self.messages is None:
            raise ValueError("add_generation_prompt needs messages")
        return self


class MarkInfo(_Reply):
    """A retention mark a session holds (docs/protocol.md, 3.5), in its current revision."""

    verb: str = Field(description="pin, decay or scratch.")
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    expires_at: float | None = Field(
        default=None,
        description="When a pin with ttl_s lapses (Unix time, seconds); none: it holds until "
        "unpinned.",
    )
    priority: int | None = Field(default=None, description="A decay's priority.")
    mode: str | None = Field(default=None, description="How a decay or scratch is dropped.")
    replacement_tokens: int | None = Field(
        default=None, description="Tokens of the stub a decay or scratch leaves."
    )


class SessionInfo(_Reply):
    session: str
    revision: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    tokens: list[TokenId] | None = Field(default=None, description="With ?tokens=true.")
    spans: list[MessageSpan] = Field(default_factory=list)
    marks: list[MarkInfo] = Field(
        default_factory=list, description="Its pin, decay and scratch marks, by start."
    )
    dropped: list[DroppedSpan] = Field(
        default_factory=list,
        description="Decay and scratch spans dropped since the session's last response "
        "(reading the session does not clear them; the next response reports them).",
    )


class SkillAnchor(_Body):
    """Context tokens a skill's block is compiled after, then dropped (docs/protocol.md, 8).

    Exactly one of ``text`` (tokenized without special tokens), ``messages`` (rendered with
    the server's chat template, no generation prompt) or ``tokens`` (used as given): what the
    block is expected to follow, e.g. the conversation's system prompt.
    """

    text: str | None = Field(default=None, min_length=1)
    messages: list[Message] | None = Field(default=None, min_length=1)
    tokens: list[TokenId] | None = Field(default=None, min_length=1)

    @model_validator(mode="after")
    def _exactly_one_source(self) -> SkillAnchor:
        _check_one_source(self)
        return self


class SkillCreate(_Body):
    """Register a skill: a block of tokens whose KV the server computes once, for compose.

    Exactly one of ``text`` (tokenized without special tokens), ``messages`` (rendered with
    the server's chat template, no generation prompt, as ``POST /tokenize`` renders them) or
    ``tokens`` (used as given).
    """

    skill: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="The id to register it under; none: the server picks one.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        description="The model to bind it to, one of the capabilities' models; none: the "
        "server's default model.",
    )
    text: str | None = Field(default=None, min_length=1)
    messages: list[Message] | None = Field(default=None, min_length=1)
    tokens: list[TokenId] | None = Field(default=None, min_length=1)
    anchor: SkillAnchor | None = Field(
        default=None,
        description="Compile the block after these tokens instead of alone from position 0; "
        "only the block's KV is kept (its keys rotated back to position 0), so its first "
        "tokens do not play the start of a sequence. Served where the capabilities say "
        "skill_anchors: true (else unsupported_option). The anchor's tokens count toward "
        "limits.max_skill_tokens with the block's.",
    )
    name: str | None = Field(
        default=None, min_length=1, max_length=256, description="A label for people."
    )
    description: str | None = Field(
        default=None, max_length=4096, description="What the skill is for, for people."
    )

    @model_validator(mode="after")
    def _exactly_one_source(self) -> SkillCreate:
        _check_one_source(self)
        return self


def _check_one_source(body: BaseModel) -> None:
    given = [n for n in ("text", "messages", "tokens") if getattr(body, n) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of text, messages, tokens (got {given or 'none'})")


class SkillInfo(_Reply):
    """A registered skill. It carries no revision: registering its id again with other
    content replaces it, and changes no session that composed it."""

    skill: str
    model: str = Field(description="The model whose KV the block holds.")
    num_tokens: int = Field(ge=1)
    content_hash: str = Field(
        description="sha256 hex over the model id, a zero byte and the token ids (8 bytes "
        "each, little-endian), then the anchor's when there is one: "
        "leyline.protocol.resources.skill_content_hash."
    )
    anchor_tokens: int = Field(
        default=0, ge=0, description="Tokens the block was compiled after (0: none)."
    )
    name: str | None = None
    description: str | None = None
    tokens: list[TokenId] | None = Field(default=None, description="With ?tokens=true.")
    anchor: list[TokenId] | None = Field(
        default=None, description="The anchor's tokens, with ?tokens=true and an anchor."
    )


class SkillList(_Reply):
    """The caller's tenant's skills (without their tokens)."""

    skills: list[SkillInfo] = Field(default_factory=list)


def skill_content_hash(model: str, tokens: Sequence[int], anchor: Sequence[int] = ()) -> str:
    """A skill's ``content_hash``: sha256, hex, over the model id (UTF-8), one zero byte, and
    each token id as 8 bytes, little-endian, signed; for an anchored skill then the 7 bytes
    ``\\0anchor`` and each anchor token id the same way. Same model, tokens and anchor, same
    hash; an unanchored skill's hash does not depend on the anchor rule."""
    digest = hashlib.sha256(model.encode("utf-8"))
    digest.update(b"\0")  # the model id cannot run into the token bytes
    _digest_ids(digest, tokens)
    if anchor:
        digest.update(b"\0anchor")  # 7 bytes: cannot be read as a token id
        _digest_ids(digest, anchor)
    return digest.hexdigest()


def _digest_ids(digest: hashlib._Hash, ids: Sequence[int]) -> None:
    for token in ids:
        digest.update(int(token).to_bytes(8, "little", signed=True))


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


class TokenizeResponse(_Reply):
    tokens: list[TokenId]
    spans: list[MessageSpan] = Field(default_factory=list)


class DetokenizeRequest(_Body):
    tokens: list[TokenId]


class DetokenizeResponse(_Reply):
    text: str
