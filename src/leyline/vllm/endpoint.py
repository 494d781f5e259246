"""The ``vllm.endpoint_plugins`` entry ``leyline``: the session core on vLLM's API server.

``attach_router`` (at ``build_app``, before the engine is up) adds one ASGI middleware;
``init_state`` (with the ``EngineClient``) builds the ``VllmBackend`` and the service. From
then on the middleware serves ``/leyline/v1`` (the core's routes) and chat / completions
bodies with a ``leyline`` object (the reference server's OpenAI routes, as on SGLang:
``openai_dispatch``). Every other request reaches vLLM unchanged, except a plain chat or
completions body whose ``cache_salt`` names a reserved, private namespace: a 422.
"""

from __future__ import annotations

import inspect
import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, cast

from fastapi import FastAPI
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from leyline.core.errors import SpliceUnsupportedError
from leyline.core.route_guard import error_response, unmatched_router
from leyline.core.routes import leyline_router
from leyline.protocol import FallbackReason, Limits
from leyline.protocol.resources import API_PREFIX
from leyline.serve.errors import install_error_handlers
from leyline.serve.openai_dispatch import ROUTED, LeylineDispatch, leyline_openai_app
from leyline.serve.service import LeylineService
from leyline.serve.settings import ServerSettings
from leyline.serve.tenant_keys import TenantKeys, tenants_from_env
from leyline.serve.tunnel import LeylineTunnel
from leyline.vllm.backend import (
    RESERVED_SALT_PREFIX,
    VllmBackend,
    VllmSession,
    reserved_salt_error,
)
from leyline.vllm.runner import EngineRunner

logger = logging.getLogger(__name__)

CONNECTOR = "LeylineConnector"


@dataclass(frozen=True, slots=True)
class Mounted:
    service: LeylineService[VllmSession]
    routes: ASGIApp
    """The core's ``/leyline/v1`` routes."""
    openai: ASGIApp
    """Chat and completions with a ``leyline`` object."""


class LeylineEndpoint:
    """The endpoint plugin (vLLM's ``EndpointPlugin`` protocol)."""

    name = "leyline"
    required_tasks: tuple[str, ...] | None = ("generate",)

    def __init__(self) -> None:
        self.mounted: Mounted | None = None

    def attach_router(self, app: FastAPI) -> None:
        app.add_middleware(LeylineMiddleware, endpoint=self)
        app.add_middleware(LeylineTunnel)  # outermost: an envelope's request meets the rest

    async def init_state(self, engine_client: Any, state: Any, args: Any) -> None:
        if engine_client is None:
            return  # vLLM's render-only server: no engine, nothing to serve
        config = engine_client.vllm_config
        if int(config.parallel_config.data_parallel_size) > 1:
            logger.warning("leyline: not served with data parallelism (sessions are not routed)")
            return
        tenants = tenants_from_env()  # a malformed keys file stops the server here, loudly
        backend = await backend_for(engine_client, args, tenants=tenants is not None)
        if backend.refusal is not None:
            logger.warning("leyline: every edit is refused: %s", backend.refusal.message)
        self.mounted = mount(backend, tenants)


def mount(backend: VllmBackend, tenants: dict[str, str] | None = None) -> Mounted:
    """The service over ``backend`` and the two apps the middleware sends requests to;
    with ``tenants`` (key -> tenant), both ask for a tenant's key. vLLM's own routes keep
    vLLM's own ``--api-key``."""
    service = LeylineService(backend, ServerSettings(), model_name=backend.model_name)
    routes = leyline_router(service.core)
    app = FastAPI(redirect_slashes=False, openapi_url=None, docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.include_router(routes)
    app.include_router(unmatched_router(API_PREFIX, routes))  # the protocol's 404 there
    openai: ASGIApp = leyline_openai_app(cast(Any, service))  # any session type
    if tenants is None:
        return Mounted(service, app, openai)
    return Mounted(service, TenantKeys(app, tenants=tenants), TenantKeys(openai, tenants=tenants))


async def backend_for(engine_client: Any, args: Any, *, tenants: bool = False) -> VllmBackend:
    """The backend for this server: its tokenizer, vocabulary, context and block size, and
    why orders cannot run (no ``LeylineConnector``, no prefix cache), if they cannot; with
    ``tenants``, each tenant's KV in namespaces named with a secret of this process."""
    config = engine_client.vllm_config
    model = config.model_config
    tokenizer = engine_client.get_tokenizer()
    if inspect.isawaitable(tokenizer):
        tokenizer = await tokenizer
    names = getattr(args, "served_model_name", None) or [model.served_model_name or model.model]
    block = int(config.cache_config.block_size)
    return VllmBackend(
        EngineRunner(engine_client),
        tokenizer,
        limits=Limits(
            max_session_tokens=session_cap(int(model.max_model_len), block),
            # A skill is one request of anchor + block that generates one token.
            max_skill_tokens=int(model.max_model_len) - 1,
        ),
        vocab_size=int(model.get_vocab_size()),
        block_size=block,
        model_name=str(names[0]),
        stop_token_ids=_stop_ids(tokenizer),
        refusal=runtime_refusal(config),
        tenant_secret=secrets.token_bytes(32) if tenants else None,
    )


def session_cap(max_model_len: int, block_size: int) -> int:
    """The longest session: a build pads a sequence with filler to its block's end
    (``build.padded``) and then generates one token, all within ``max_model_len``."""
    return max(1, (max_model_len - 1) // block_size * block_size - 1)


def runtime_refusal(config: Any) -> SpliceUnsupportedError | None:
    """Why no order can run on this engine's configuration, or None."""
    transfer = config.kv_transfer_config
    if transfer is None or transfer.kv_connector != CONNECTOR:
        named = None if transfer is None else transfer.kv_connector
        return SpliceUnsupportedError(
            FallbackReason.unsupported_runtime,
            f"the KV connector is {named!r}, not {CONNECTOR!r} (--kv-transfer-config): "
            "nothing can write KV",
        )
    if not config.cache_config.enable_prefix_caching:
        return SpliceUnsupportedError(
            FallbackReason.unsupported_runtime,
            "prefix caching is off: nothing is cached to splice from or purge",
        )
    return None


def _stop_ids(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return () if eos is None else (int(eos),)


class LeylineMiddleware:
    """Routes the plugin's requests once ``init_state`` mounted them; vLLM gets the rest."""

    def __init__(self, app: ASGIApp, endpoint: LeylineEndpoint) -> None:
        self.app = app
        self.endpoint = endpoint
        self.plain = ReservedSaltGuard(app)
        self._dispatch: tuple[Mounted, ASGIApp] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        mounted = self.endpoint.mounted
        if scope["type"] != "http" or mounted is None:
            await self.app(scope, receive, send)
            return
        path = str(scope["path"])
        if path == API_PREFIX or path.startswith(API_PREFIX + "/"):
            await mounted.routes(scope, receive, send)
            return
        if self._dispatch is None or self._dispatch[0] is not mounted:
            self._dispatch = (mounted, LeylineDispatch(self.plain, leyline_app=mounted.openai))
        await self._dispatch[1](scope, receive, send)


class ReservedSaltGuard:
    """A plain chat or completions body naming a reserved ``cache_salt`` gets a 422: the
    private namespaces' names are the server's (docs/vllm-design.md)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTED:
            await self.app(scope, receive, send)
            return
        messages: list[Message] = []
        more = True
        while more:  # LeylineDispatch already read it whole and bounded its size
            message = await receive()
            messages.append(message)
            more = message["type"] == "http.request" and bool(message.get("more_body"))
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if reserved_salt(body):
            await error_response(reserved_salt_error())(scope, receive, send)
            return
        replay = iter(messages)

        async def replayed() -> Message:
            return next(replay, None) or await receive()

        await self.app(scope, replayed, send)


def reserved_salt(body: bytes) -> bool:
    """Whether a JSON body's top-level ``cache_salt`` names a reserved namespace."""
    if RESERVED_SALT_PREFIX.encode() not in body:
        return False  # cheap: most bodies never parse here
    try:
        parsed = json.loads(body)
    except ValueError:
        return False  # vLLM answers malformed JSON as it always does
    salt = parsed.get("cache_salt") if isinstance(parsed, dict) else None
    return isinstance(salt, str) and salt.startswith(RESERVED_SALT_PREFIX)
