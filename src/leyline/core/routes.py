"""The ``/leyline/v1`` resources, mounted by both servers (the reference app and SGLang's).

The router is self-contained: its routes check the raw body and answer every failure with
the protocol's error body by themselves (``route_guard.LeylineRoute``), so mounting it on
another server's app changes nothing of that app's own routes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request, Response

from leyline.core.route_guard import LeylineRoute
from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT
from leyline.protocol import Capabilities, LeylineResponse
from leyline.protocol.resources import (
    ApplyDirectives,
    DetokenizeRequest,
    DetokenizeResponse,
    Routes,
    SessionCreate,
    SessionInfo,
    SkillCreate,
    SkillInfo,
    SkillList,
    TokenizeRequest,
    TokenizeResponse,
)
from leyline.protocol.schema import build_schema


def tenant_of(request: Request) -> str:
    """The tenant an authenticated request belongs to (set by the server's auth layer)."""
    return str(getattr(request.state, "tenant", None) or DEFAULT_TENANT)


def client_gone(request: Request) -> Callable[[], bool] | None:
    """Whether the request's client has hung up, where the server's transport tracks it
    (``request.state.client_gone``, set by ``leyline serve``'s middleware), else None."""
    return getattr(request.state, "client_gone", None)


def leyline_router(service: SessionService[Any]) -> APIRouter:
    router = APIRouter(tags=["Leyline"], route_class=LeylineRoute)

    @router.get(Routes.capabilities)
    async def capabilities() -> Capabilities:
        return service.capabilities()

    @router.post(Routes.sessions, status_code=201)
    async def create_session(body: SessionCreate, request: Request) -> SessionInfo:
        """Create a session, optionally prefilled from messages, text or token ids."""
        return await service.create(tenant_of(request), body)

    @router.get(Routes.session)
    async def get_session(session: str, request: Request, tokens: bool = False) -> SessionInfo:
        return await service.get(tenant_of(request), session, tokens)

    @router.delete(Routes.session, status_code=204)
    async def delete_session(session: str, request: Request) -> Response:
        await service.delete(tenant_of(request), session)
        return Response(status_code=204)

    @router.post(Routes.directives)
    async def apply_directives(
        session: str, body: ApplyDirectives, request: Request
    ) -> LeylineResponse:
        """Apply a batch without generating (all-or-nothing; 409 on a stale revision)."""
        return await service.apply(tenant_of(request), session, body, client_gone(request))

    @router.post(Routes.skills, status_code=201)
    async def create_skill(body: SkillCreate, request: Request) -> SkillInfo:
        """Register a skill for compose: its KV is computed once, from position 0."""
        return await service.create_skill(tenant_of(request), body)

    @router.get(Routes.skills)
    async def list_skills(request: Request) -> SkillList:
        return await service.list_skills(tenant_of(request))

    @router.get(Routes.skill)
    async def get_skill(skill: str, request: Request, tokens: bool = False) -> SkillInfo:
        return await service.get_skill(tenant_of(request), skill, tokens)

    @router.delete(Routes.skill, status_code=204)
    async def delete_skill(skill: str, request: Request) -> Response:
        await service.delete_skill(tenant_of(request), skill)
        return Response(status_code=204)

    @router.post(Routes.tokenize)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await service.tokenize(body)

    @router.post(Routes.detokenize)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await service.detokenize(body)

    @router.get(Routes.schema)
    async def schema() -> dict[str, Any]:
        return build_schema()

    return router
