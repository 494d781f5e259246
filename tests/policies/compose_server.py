"""A SCRIPTED Leyline server that executes ``compose``, on the TOY rendering of ``toy_chat``.

For tests only, and not a model: no KV, no torch. It answers through
``httpx.MockTransport`` (no sockets) what the protocol says a server answers:

* ``GET /leyline/v1/capabilities`` (``compose`` among the verbs unless ``compose=False``;
  ``compose_recompute``: the recompute modes it accepts, ``none`` unless told);
* ``POST /leyline/v1/tokenize`` with the toy rendering;
* ``POST /leyline/v1/skills`` (tokens, text or messages -> id, num_tokens, content_hash; the
  same content under an id answers the skill it holds), ``GET`` / ``DELETE`` one;
* ``POST /v1/chat/completions``: a chat request's ``leyline`` batch is resolved against the
  session (``resolve_batch``, skills included), applied (``apply_edits``), and the request's
  rendered prompt must extend the edited tokens; anything else is recorded in ``mismatches``
  and answered as the reference server does (``reprefill`` / ``token_mismatch``); a
  compose asking for a recompute mode it does not list is refused (``unsupported_option``,
  as ``resolve_batch`` does) and otherwise only recorded: the toy has no KV to recompute. It
  "generates" ``reply N`` and caches the generation prompt and reply after the prompt, as a
  real server does (in the toy rendering they are exactly the reply message's tokens).
"""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import httpx
import openai
from pydantic import TypeAdapter

from leyline.policies.skill_refs import SKILL_KEY
from leyline.protocol import (
    ComposedBlock,
    Directive,
    ErrorCode,
    LeylineError,
    LeylineResponse,
    Path,
    RecomputeMode,
    Verb,
    apply_edits,
    resolve_batch,
)
from leyline.protocol.client import AsyncLeylineClient, LeylineClient
from leyline.protocol.resources import SkillCreate, SkillInfo, skill_content_hash

from ..protocol.composed_blocks import composed_blocks
from .sse import sse
from .toy_chat import END, ROLE, SEP, render, tokenize

_openai_base = importlib.import_module("openai._base_client")
OPENAI_HTTPX: ModuleType = getattr(_openai_base, "httpx2", None) or _openai_base.httpx
"""The HTTP library the installed openai speaks (openai 3 ships its own fork, httpx2)."""

BASE = "http://leyline.test"
MODEL = "toy"
GENERATION_PROMPT = (ROLE["assistant"], SEP)
_DIRECTIVES: TypeAdapter[list[Directive]] = TypeAdapter(list[Directive])


@dataclass
class _Session:
    tokens: list[int] = field(default_factory=list)
    spans: list[Any] = field(default_factory=list)
    revision: int = 0


class ComposeServer:
    def __init__(
        self, *, compose: bool = True, recompute: tuple[RecomputeMode, ...] = (RecomputeMode.none,)
    ) -> None:
        self.verbs = [Verb.splice, Verb.forget, Verb.erratum] + ([Verb.compose] if compose else [])
        self.recompute_modes = recompute
        self.skills: dict[str, tuple[int, ...]] = {}
        self.registrations: list[dict[str, Any]] = []
        """Bodies of ``POST /leyline/v1/skills``, in order."""
        self.chats: list[dict[str, Any]] = []
        """Bodies of the chat requests, in order (summary requests, without a session,
        included)."""
        self.mismatches: list[str] = []
        """Requests whose prompt did not extend the edited cache (a client bug)."""
        self.leaks: list[dict[str, Any]] = []
        """Messages that reached the server with the SDK's side field."""
        self.sessions: dict[str, _Session] = {}

    # -- clients on this transport ---------------------------------------------------

    def transport(self, http: ModuleType = httpx) -> Any:
        """A mock transport of ``http`` (httpx, or the openai's own) answering as this server."""

        def handle(request: Any) -> Any:
            status, body = self.answer(request.method, request.url.path, request.content)
            if isinstance(body, bytes):
                headers = {"content-type": "text/event-stream"}
                return http.Response(status, content=body, headers=headers)
            return http.Response(status, json=body) if body is not None else http.Response(status)

        return http.MockTransport(handle)

    def openai(self) -> openai.OpenAI:
        http = OPENAI_HTTPX.Client(transport=self.transport(OPENAI_HTTPX))
        return openai.OpenAI(base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http)

    def async_openai(self) -> openai.AsyncOpenAI:
        http = OPENAI_HTTPX.AsyncClient(transport=self.transport(OPENAI_HTTPX))
        return openai.AsyncOpenAI(
            base_url=f"{BASE}/v1", api_key="t", max_retries=0, http_client=http
        )

    def leyline(self) -> LeylineClient:
        return LeylineClient(BASE, http_client=httpx.Client(transport=self.transport()))

    def async_leyline(self) -> AsyncLeylineClient:
        return AsyncLeylineClient(BASE, http_client=httpx.AsyncClient(transport=self.transport()))

    # -- routes ----------------------------------------------------------------------

    def answer(self, method: str, path: str, content: bytes) -> tuple[int, Any]:
        """Status and JSON body (None: no body) of one request."""
        body = json.loads(content) if content else {}
        route = (method, path)
        try:
            if route == ("GET", "/leyline/v1/capabilities"):
                verbs = [v.value for v in self.verbs]
                recompute = [m.value for m in self.recompute_modes]
                caps = {"verbs": verbs, "models": [MODEL], "compose_recompute": recompute}
                return 200, {"protocol_version": "1.0", **caps}
            if route == ("POST", "/leyline/v1/tokenize"):
                return 200, self._tokenize(body)
            if route == ("POST", "/leyline/v1/skills") and Verb.compose in self.verbs:
                return 201, self._register(body)
            if path.startswith("/leyline/v1/skills/"):
                return self._skill(method, path.rsplit("/", 1)[1])
            if route == ("POST", "/v1/chat/completions") and body.get("stream"):
                usage = bool((body.get("stream_options") or {}).get("include_usage"))
                return 200, sse(self._chat(body), include_usage=usage, usage_apart=False)
            if route == ("POST", "/v1/chat/completions"):
                return 200, self._chat(body)
            if method == "DELETE" and path.startswith("/leyline/v1/sessions/"):
                return 204, None
            raise LeylineError(ErrorCode.not_found, f"no route {route}")
        except LeylineError as exc:
            return exc.http_status, exc.to_body().model_dump(mode="json")

    def _tokenize(self, body: dict[str, Any]) -> dict[str, Any]:
        self._check_wire(body.get("messages") or [])
        if body.get("text") is not None:
            return {"tokens": tokenize(body["text"]), "spans": []}
        rendered: dict[str, Any] = render(body["messages"]).model_dump(mode="json")
        return rendered

    def _register(self, body: dict[str, Any]) -> dict[str, Any]:
        self.registrations.append(body)
        create = SkillCreate.model_validate(body)
        if create.tokens is not None:
            tokens = tuple(create.tokens)
        elif create.text is not None:
            tokens = tuple(tokenize(create.text))
        else:
            tokens = tuple(render(create.messages or []).tokens)
        skill = create.skill or f"skill-{len(self.registrations)}"
        self.skills[skill] = tokens
        info: dict[str, Any] = self._info(skill).model_dump(mode="json")
        return info

    def _info(self, skill: str) -> SkillInfo:
        tokens = self.skills[skill]
        return SkillInfo(
            skill=skill,
            model=MODEL,
            num_tokens=len(tokens),
            content_hash=skill_content_hash(MODEL, tokens),
        )

    def _skill(self, method: str, skill: str) -> tuple[int, Any]:
        if skill not in self.skills:
            raise LeylineError(ErrorCode.unknown_skill, f"no skill {skill!r}", "skill")
        if method == "DELETE":
            del self.skills[skill]
            return 204, None
        return 200, self._info(skill).model_dump(mode="json")

    def _check_wire(self, messages: list[dict[str, Any]]) -> None:
        self.leaks += [m for m in messages if SKILL_KEY in m]

    # -- one chat turn ---------------------------------------------------------------

    def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        self.chats.append(body)
        self._check_wire(body["messages"])
        leyline = body.get("leyline") or {}
        rendered = render(body["messages"])
        prompt = [*rendered.tokens, *GENERATION_PROMPT]
        sid = leyline.get("session")
        directives = _DIRECTIVES.validate_python(leyline.get("directives") or [])
        if directives:
            session = self.sessions.get(sid) if sid else None
            if session is None:
                raise LeylineError(ErrorCode.unknown_session, f"no session {sid!r}", "session")
            if leyline.get("base_revision") != session.revision:
                raise LeylineError(ErrorCode.revision_conflict, "stale", "base_revision")
            reused, path, composed = self._edit(session, directives, prompt)
        else:
            session = self.sessions.get(sid) if sid else None
            reused, path, composed = _extend(session, prompt), Path.reprefill, []
            if session is not None and reused == len(session.tokens):
                path = Path.prefix_hit
        session = self.sessions.setdefault(sid, _Session()) if sid else _Session()
        n = len(self.chats)
        generated = [*tokenize(f"reply {n}"), END]
        session.tokens, session.spans = [*prompt, *generated], list(rendered.spans)
        session.revision += 1
        reused = min(reused, len(prompt))
        response = LeylineResponse(
            session=sid,
            revision=session.revision,
            path=path,
            reused_tokens=reused,
            prefilled_tokens=len(prompt) - reused,
            rotated_tokens=0,
            spans=rendered.spans,
            composed=composed,
        )
        message = {"role": "assistant", "content": f"reply {n}"}
        return {
            "id": f"chatcmpl-{n}",
            "object": "chat.completion",
            "created": 0,
            "model": MODEL,
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(generated),
                "total_tokens": len(prompt) + len(generated),
            },
            "leyline": response.model_dump(mode="json"),
        }

    def _edit(
        self, session: _Session, directives: list[Directive], prompt: list[int]
    ) -> tuple[int, Path, list[ComposedBlock]]:
        """Apply the batch; the prompt must extend the edited tokens (else: a mismatch)."""
        batch = resolve_batch(
            directives,
            length=len(session.tokens),
            tokenize=tokenize,
            spans=session.spans,
            supported=self.verbs,
            skill_tokens=self.skills.get,
            recompute_modes=self.recompute_modes,
        )
        result = apply_edits(session.tokens, batch.edits)
        edited = list(result.tokens)
        if prompt[: len(edited)] != edited:
            self.mismatches.append(f"chat {len(self.chats)}: the prompt does not extend the edit")
            return 0, Path.reprefill, []
        composed = composed_blocks(len(session.tokens), batch)
        precompiled = sum(c.num_tokens - c.seam_tokens for c in batch.composes)
        return result.reused_tokens + precompiled, Path.splice, composed


def _extend(session: _Session | None, prompt: list[int]) -> int:
    """Tokens of the prompt the session already holds (its longest common prefix)."""
    cached = session.tokens if session is not None else []
    reused = 0
    while reused < min(len(cached), len(prompt)) and cached[reused] == prompt[reused]:
        reused += 1
    return reused
