"""The FastAPI application: OpenAI-compatible routes, Leyline resources, health, metrics."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from leyline.protocol import PROTOCOL_VERSION, ErrorCode, LeylineError

from ..core.routes import leyline_router
from ..engine import Engine
from .errors import BodyLimit, error_response, install_error_handlers
from .routes_openai import openai_router
from .service import LeylineService
from .settings import ServerSettings

_OPEN_PATHS = frozenset({"/health", "/docs", "/openapi.json", "/docs/oauth2-redirect"})


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    service = LeylineService(engine, settings)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        service.shutdown()

    app = FastAPI(
        lifespan=lifespan,
        title="Leyline",
        version=PROTOCOL_VERSION,
        description="OpenAI-compatible serving with KV-cache directives (splice, forget, "
        "erratum). See docs/protocol.md.",
    )
    app.state.service = service
    install_error_handlers(app)
    app.include_router(openai_router(service))
    app.include_router(leyline_router(service.core))

    @app.get("/health", tags=["Operations"])
    async def health() -> dict[str, object]:
        return {"status": "ok", "model": service.model_name, "sessions": len(service.sessions)}

    @app.get("/metrics", tags=["Operations"])
    async def metrics() -> Response:
        service.metrics.sessions.set(len(service.sessions))
        service.metrics.cache_bytes.set(service.sessions.total_bytes())
        if engine.prefix_cache is not None:
            service.metrics.prefix_cache_bytes.set(engine.prefix_cache.stats().bytes_used)
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.middleware("http")
    async def guard(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        if settings.api_key and request.url.path not in _OPEN_PATHS:
            given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
            if not hmac.compare_digest(given.encode(), settings.api_key.encode()):
                response: Response = error_response(
                    LeylineError(
                        ErrorCode.unauthorized,
                        "missing or wrong API key (Authorization: Bearer ...)",
                        "authorization",
                    )
                )
                return response
        response = await call_next(request)
        route = request.scope.get("route")
        name = getattr(route, "path", "unmatched")
        service.metrics.requests.labels(name, str(response.status_code)).inc()
        return response

    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    return app
