"""The wire side of the OpenAI-client wrappers: probing, request options, tokenize, errors.

No I/O here; :mod:`.middleware` and :mod:`.middleware_async` send what these build.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import openai
from pydantic import BaseModel, ValidationError

from leyline.protocol import (
    PROTOCOL_VERSION,
    Capabilities,
    ComposeDirective,
    Verb,
    is_compatible,
)
from leyline.protocol.resources import TokenizeRequest, TokenizeResponse

from .messages import Message
from .skill_refs import SkillLookup
from .skills import SkillSet

LEYLINE_KEY = "leyline"
"""The key of the Leyline object in a request body (``extra_body``) and in a response."""


@dataclass(frozen=True, slots=True)
class ServerSupport:
    """What the capabilities probe found."""

    leyline: bool
    """Directives can be sent: a compatible Leyline server that executes ``splice``."""
    note: str
    """What was found, in words."""
    capabilities: Capabilities | None = None

    @property
    def compose(self) -> bool:
        """Skills can be composed: a Leyline server whose verbs include ``compose``."""
        caps = self.capabilities
        return self.leyline and caps is not None and Verb.compose in caps.verbs


def support_from_capabilities(data: object) -> ServerSupport:
    """Judge the body of ``GET /leyline/v1/capabilities``."""
    try:
        caps = Capabilities.model_validate(data)
    except ValidationError:
        return ServerSupport(False, "the capabilities route answered something else")
    if not is_compatible(PROTOCOL_VERSION, caps.protocol_version):
        note = f"Leyline {caps.protocol_version} is incompatible with {PROTOCOL_VERSION}"
        return ServerSupport(False, note, caps)
    if Verb.splice not in caps.verbs:
        return ServerSupport(False, "the server does not execute splice", caps)
    verbs = ", ".join(v.value for v in caps.verbs)
    return ServerSupport(True, f"Leyline {caps.protocol_version} (verbs: {verbs})", caps)


def support_from_status(status: int) -> ServerSupport:
    """The capabilities route answered with an error status: a server without Leyline."""
    what = "not found" if status == 404 else f"HTTP {status}"
    return ServerSupport(False, f"no Leyline capabilities route ({what})")


def normalize_messages(messages: Iterable[object]) -> list[Message]:
    """The agent's messages as mappings: dicts stay, OpenAI message objects are dumped."""
    out: list[Message] = []
    for i, message in enumerate(messages):
        if isinstance(message, Mapping):
            out.append(message)
        elif isinstance(message, BaseModel):
            out.append(message.model_dump(mode="json", exclude_none=True))
        else:
            raise TypeError(f"message {i} is a {type(message).__name__}, not a chat message")
    return out


def server_root(base_url: object) -> str:
    """``http://host:8000/v1`` -> ``http://host:8000`` (the Leyline routes hang off the root)."""
    root = str(base_url).rstrip("/")
    return root[: -len("/v1")] if root.endswith("/v1") else root


class RenderUnavailable(Exception):
    """The server could not render messages for the planner (its tokenize failed)."""


def extra_body_of(kwargs: dict[str, Any]) -> dict[str, object]:
    """Check a call's options; pop and return its ``extra_body``.

    Raises:
        ValueError: ``stream=True``, or ``extra_body`` already carries ``leyline``.
    """
    if kwargs.get("stream"):
        raise ValueError("the Leyline wrapper does not stream; call without stream=True")
    extra = kwargs.pop("extra_body", None) or {}
    if not isinstance(extra, dict):
        raise ValueError("extra_body must be a dict")
    if LEYLINE_KEY in extra:
        raise ValueError("extra_body['leyline'] is the wrapper's to set; leave it out")
    return extra


def renderer(
    tokenize: Callable[[Sequence[Message], list[object] | None], TokenizeResponse], tools: object
) -> Callable[[Sequence[Message]], TokenizeResponse]:
    """The planner's ``render``: the server's tokens and spans, with the call's tool list."""
    listed = list(tools) if isinstance(tools, list | tuple) else None
    return lambda messages: tokenize(messages, listed)


def tokenize_body(messages: Sequence[Message], tools: list[object] | None) -> dict[str, object]:
    """The body of ``POST /leyline/v1/tokenize`` for a message list and a tool list."""
    request = TokenizeRequest.model_validate(
        {"messages": [dict(m) for m in messages], "tools": tools}
    )
    return request.model_dump(mode="json", exclude_none=True)


def composes(skills: SkillSet | None, support: ServerSupport) -> SkillLookup | None:
    """The planner's skill lookup: only where the server executes ``compose``."""
    return skills.lookup if skills is not None and support.compose else None


SKILL_ERRORS = frozenset({"unknown_skill", "skill_mismatch"})
"""Codes that say a skill cannot be composed in this session until registered again."""


def failed_skills(exc: openai.APIError, directives: Sequence[object]) -> list[str]:
    """The skills a refused batch names as the cause (all its composes when the error's
    ``field`` does not point at one); none unless the code is a skill error."""
    skills = {i: d.skill for i, d in enumerate(directives) if isinstance(d, ComposeDirective)}
    if not isinstance(exc, openai.APIStatusError) or exc.code not in SKILL_ERRORS:
        return []
    body = exc.body if isinstance(exc.body, Mapping) else {}
    found = re.match(r"directives\[(\d+)\]", str(body.get("field") or ""))
    if found and int(found.group(1)) in skills:
        return [skills[int(found.group(1))]]
    return list(skills.values())


def resync_reason(exc: openai.APIError) -> str:
    """Why a request with directives failed, in a few words (the Leyline code if any)."""
    if isinstance(exc, openai.APIStatusError):
        return exc.code or f"HTTP {exc.status_code}"
    return f"{type(exc).__name__}: {exc}"[:200]
