"""The FastAPI application: OpenAI-compatible routes, Leyline resources, health, metrics."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response

from leyline.core.routes import leyline_router
from leyline.engine.backend import EngineBackend
from leyline.engine.engine import Engine
from leyline.protocol import PROTOCOL_VERSION
from leyline.serve.access import Access
from leyline.serve.errors import BodyLimit, HeadAsGet, install_error_handlers
from leyline.serve.jobs import ClientGone
from leyline.serve.routes_openai import openai_router
from leyline.serve.service import Cancelled, LeylineService
from leyline.serve.settings import ServerSettings
from leyline.serve.tunnel import ENVELOPE_SLACK, LeylineTunnel
from leyline.serve.worker import WorkerName, model_path, worker_info_router

CLIENT_CLOSED = 499
"""The status of a request whose client left before its model work started."""


def create_app(engine: Engine, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    name = settings.served_model_name or engine.loaded.name
    # Tenants: the access layer below maps each API key to one (access.py).
    backend = EngineBackend(
        engine,
        limits=settings.limits,
        model_name=name,
        tenants=True,
        max_jobs=settings.max_running_jobs,
        max_batch=settings.max_decode_batch,
        decode_share=settings.decode_share,
        schedule=settings.schedule,
        schedule_aging=settings.schedule_aging,
    )
    service = LeylineService(backend, settings, model_name=name)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        backend.shutdown()

    app = FastAPI(
        lifespan=lifespan,
        # No trailing-slash redirects: an unknown path is a 404 with the protocol's body,
        # never an empty 307 (session ids are path segments).
        redirect_slashes=False,
        title="Leyline",
        version=PROTOCOL_VERSION,
        description="OpenAI-compatible serving with KV-cache directives (splice, forget, "
        "erratum). See docs/protocol.md.",
    )
    app.state.service = service
    app.state.engine = engine
    install_error_handlers(app)

    @app.exception_handler(Cancelled)
    async def _client_left(_: Request, exc: Cancelled) -> Response:
        # Nobody reads this answer; 499 (nginx's "client closed request") counts it apart.
        return Response(status_code=CLIENT_CLOSED)

    app.include_router(openai_router(service))
    app.include_router(leyline_router(service.core))

    @app.get("/health", tags=["Operations"])
    async def health() -> dict[str, object]:
        # Open to anyone: says nothing about sessions (their count is in /metrics, keyed).
        return {"status": "ok", "model": service.model_name}

    # Open too, for a router registering this worker: the model's name and path only.
    app.include_router(worker_info_router(name, model_path(settings.model, engine.loaded.name)))

    @app.get("/metrics", tags=["Operations"])
    async def metrics() -> Response:
        service.metrics.sessions.set(len(service.sessions))
        service.metrics.cache_bytes.set(service.sessions.total_bytes())
        if engine.prefix_cache is not None:
            service.metrics.prefix_cache_bytes.set(engine.prefix_cache.stats().bytes_used)
        service.metrics.record_scheduler(backend.scheduler.stats())
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_middleware(ClientGone)
    app.add_middleware(Access, tenants=settings.tenants_by_key(), metrics=service.metrics)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(HeadAsGet)  # Access counts a HEAD by its GET route
    # An envelope (a Leyline request inside POST /v1/completions, for routers that forward
    # only the OpenAI routes) is unpacked above every check, so its request meets them all.
    app.add_middleware(LeylineTunnel, max_body_bytes=settings.max_body_bytes + ENVELOPE_SLACK)
    if settings.worker_name is not None:
        # Outermost: every answer the app gives carries it, a 401 or 413 of the layers
        # below included.
        app.add_middleware(WorkerName, name=settings.worker_name)
    return app
