"""Who may call, as which tenant, and a count of every answer: one pure ASGI middleware.

Pure ASGI rather than ``@app.middleware("http")``: Starlette's ``BaseHTTPMiddleware`` runs
the endpoint behind its own receive channel, where a client that hangs up is never seen,
so a plain (non-streamed) request whose client left would generate to the end.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.protocol import ErrorCode, LeylineError
from leyline.serve.errors import error_response
from leyline.serve.metrics import Metrics

OPEN_PATHS = frozenset(
    {
        "/health",
        "/server_info",  # what a router reads from a worker it registers (worker.py)
        "/model_info",
        "/docs",
        "/openapi.json",
        "/docs/oauth2-redirect",
    }
)


class Access:
    """API keys -> tenant (``request.state.tenant``); requests counted by route and status.

    ``tenants`` maps each accepted key to its tenant; empty means an open server.
    """

    def __init__(self, app: ASGIApp, *, tenants: dict[str, str], metrics: Metrics) -> None:
        self.app = app
        self.tenants = tenants
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            if self.tenants and scope["path"] not in OPEN_PATHS:
                tenant = bearer_tenant(scope, self.tenants)
                if tenant is None:
                    await error_response(unauthorized())(scope, receive, counted)
                    return
                # Sessions and shared-cache partitions are the tenant's (core.routes.tenant_of).
                scope.setdefault("state", {})["tenant"] = tenant
            await self.app(scope, receive, counted)
        finally:
            route = getattr(scope.get("route"), "path", "unmatched")
            self.metrics.requests.labels(route, str(status)).inc()


def bearer_tenant(scope: Scope, tenants: dict[str, str]) -> str | None:
    """The tenant whose key the request's ``Authorization: Bearer`` header carries."""
    headers = dict(scope.get("headers") or [])
    given = headers.get(b"authorization", b"").decode("latin-1")
    return tenant_of_key(tenants, given.removeprefix("Bearer ").strip())


def unauthorized() -> LeylineError:
    return LeylineError(
        ErrorCode.unauthorized,
        "missing or wrong API key (Authorization: Bearer ...)",
        "authorization",
    )


def tenant_of_key(tenants: dict[str, str], given: str) -> str | None:
    """The tenant of ``given``, compared in constant time against every key."""
    found = None
    for key, tenant in tenants.items():
        if hmac.compare_digest(given.encode(), key.encode()):
            found = tenant
    return found
