"""API keys -> tenants for a host plugin's own requests, leaving the host's routes alone.

``leyline serve`` checks every route (``http.access.Access``). Inside SGLang or vLLM the
plugin owns only the ``/leyline/v1`` routes and the chat / completions requests that carry
a ``leyline`` object; the host's own routes keep the host's own ``--api-key``. So this
middleware checks the key only where the plugin answers and sets ``request.state.tenant``
there, as the core's routes read it (``core.routes.tenant_of``).
"""

from __future__ import annotations

import os
from pathlib import Path

from starlette.types import ASGIApp, Receive, Scope, Send

from leyline.core.route_guard import error_response
from leyline.serve.access import bearer_tenant, unauthorized
from leyline.serve.settings import load_api_keys

KEYS_FILE_ENV = "LEYLINE_API_KEYS_FILE"
"""``TENANT KEY`` per line, as ``leyline serve --api-keys-file`` reads it."""


def tenants_from_env() -> dict[str, str] | None:
    """Key -> tenant from the file ``LEYLINE_API_KEYS_FILE`` names; None when unset.
    Raises ValueError naming the file and line of a malformed entry (the server does not
    start half-configured)."""
    path = os.environ.get(KEYS_FILE_ENV)
    if not path:
        return None
    return {key: tenant for tenant, key in load_api_keys(Path(path))}


class TenantKeys:
    """Requests under ``prefix`` must carry a tenant's key (``Authorization: Bearer``):
    401 ``unauthorized`` otherwise, with the protocol's body; others pass untouched."""

    def __init__(self, app: ASGIApp, *, tenants: dict[str, str], prefix: str = "") -> None:
        self.app = app
        self.tenants = tenants
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(self.prefix):
            await self.app(scope, receive, send)
            return
        tenant = bearer_tenant(scope, self.tenants)
        if tenant is None:
            await error_response(unauthorized())(scope, receive, send)
            return
        scope.setdefault("state", {})["tenant"] = tenant
        await self.app(scope, receive, send)
