"""One description per resource call, shared by the sync and async clients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar
from urllib.parse import quote, urlencode

import httpx
from pydantic import BaseModel, TypeAdapter, ValidationError

from .capabilities import Capabilities
from .directives import Directive
from .envelope import LeylineResponse, RequestOptions
from .errors import ErrorCode, ErrorEnvelope, LeylineError
from .resources import (
    ApplyDirectives,
    DetokenizeRequest,
    DetokenizeResponse,
    Message,
    Routes,
    SessionCreate,
    SessionInfo,
    SkillAnchor,
    SkillCreate,
    SkillInfo,
    SkillList,
    TokenizeRequest,
    TokenizeResponse,
)

T = TypeVar("T")


class LeylineHTTPError(Exception):
    """The server answered with a status and a body that is not a Leyline error."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status
        self.body = body


@dataclass(frozen=True, slots=True)
class Call(Generic[T]):
    method: str
    path: str
    result: TypeAdapter[T]
    body: BaseModel | None = None
    params: dict[str, str] = field(default_factory=dict)

    def request_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"params": self.params} if self.params else {}
        if self.body is not None:
            kwargs["json"] = self.json_body()
        return kwargs

    def json_body(self) -> Any:
        """The JSON body (None: the call sends none)."""
        return None if self.body is None else self.body.model_dump(mode="json", exclude_none=True)

    def target(self) -> str:
        """The path with its query (what an envelope's ``route.path`` carries)."""
        return f"{self.path}?{urlencode(self.params)}" if self.params else self.path

    def parse(self, response: httpx.Response) -> T:
        if response.is_success:
            return self.result.validate_json(response.content or b"null")
        try:
            envelope = ErrorEnvelope.model_validate_json(response.content)
        except ValidationError:
            raise LeylineHTTPError(response.status_code, response.text) from None
        raise LeylineError.from_body(envelope)


_CAPS = TypeAdapter(Capabilities)
_INFO = TypeAdapter(SessionInfo)
_SKILL = TypeAdapter(SkillInfo)
_SKILLS = TypeAdapter(SkillList)
_APPLIED = TypeAdapter(LeylineResponse)
_TOKENS = TypeAdapter(TokenizeResponse)
_TEXT = TypeAdapter(DetokenizeResponse)
_NONE: TypeAdapter[None] = TypeAdapter(type(None))
_SCHEMA: TypeAdapter[dict[str, Any]] = TypeAdapter(dict[str, Any])


def _session_path(template: str, session: str) -> str:
    if not session:
        raise LeylineError(ErrorCode.unknown_session, "the session id is empty", "session")
    return template.format(session=quote(session, safe=""))


def _skill_path(skill: str) -> str:
    if not skill:
        raise LeylineError(ErrorCode.unknown_skill, "the skill id is empty", "skill")
    return Routes.skill.format(skill=quote(skill, safe=""))


def capabilities() -> Call[Capabilities]:
    return Call("GET", Routes.capabilities, _CAPS)


def create_session(
    session: str | None,
    messages: Sequence[Message] | None,
    text: str | None,
    tokens: Sequence[int] | None,
    cache_salt: str | None = None,
) -> Call[SessionInfo]:
    body = SessionCreate(
        session=session,
        messages=list(messages) if messages is not None else None,
        text=text,
        tokens=list(tokens) if tokens is not None else None,
        cache_salt=cache_salt,
    )
    return Call("POST", Routes.sessions, _INFO, body)


def get_session(session: str, include_tokens: bool) -> Call[SessionInfo]:
    params = {"tokens": "true"} if include_tokens else {}
    return Call("GET", _session_path(Routes.session, session), _INFO, params=params)


def delete_session(session: str) -> Call[None]:
    return Call("DELETE", _session_path(Routes.session, session), _NONE)


def apply(
    session: str,
    base_revision: int,
    directives: Sequence[Directive],
    options: RequestOptions | None,
) -> Call[LeylineResponse]:
    body = ApplyDirectives(
        base_revision=base_revision,
        directives=list(directives),
        options=options or RequestOptions(),
    )
    return Call("POST", _session_path(Routes.directives, session), _APPLIED, body)


def create_skill(
    skill: str | None,
    text: str | None,
    messages: Sequence[Message] | None,
    tokens: Sequence[int] | None,
    model: str | None,
    name: str | None,
    description: str | None,
    anchor: SkillAnchor | None = None,
) -> Call[SkillInfo]:
    body = SkillCreate(
        skill=skill,
        model=model,
        text=text,
        messages=list(messages) if messages is not None else None,
        tokens=list(tokens) if tokens is not None else None,
        name=name,
        description=description,
        anchor=anchor,
    )
    return Call("POST", Routes.skills, _SKILL, body)


def get_skill(skill: str, include_tokens: bool) -> Call[SkillInfo]:
    params = {"tokens": "true"} if include_tokens else {}
    return Call("GET", _skill_path(skill), _SKILL, params=params)


def list_skills() -> Call[SkillList]:
    return Call("GET", Routes.skills, _SKILLS)


def delete_skill(skill: str) -> Call[None]:
    return Call("DELETE", _skill_path(skill), _NONE)


def tokenize(
    text: str | None, messages: Sequence[Message] | None, add_generation_prompt: bool
) -> Call[TokenizeResponse]:
    body = TokenizeRequest(
        text=text,
        messages=list(messages) if messages is not None else None,
        add_generation_prompt=add_generation_prompt,
    )
    return Call("POST", Routes.tokenize, _TOKENS, body)


def detokenize(tokens: Sequence[int]) -> Call[DetokenizeResponse]:
    return Call("POST", Routes.detokenize, _TEXT, DetokenizeRequest(tokens=list(tokens)))


def schema() -> Call[dict[str, Any]]:
    return Call("GET", Routes.schema, _SCHEMA)
