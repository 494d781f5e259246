"""What a router reads from ``leyline serve`` as one of its workers (docs/router-design.md, 2).

sglang-router 0.3.2 asks a worker it registers for ``GET /server_info`` (the model's name,
else it lists the worker's model as ``"unknown"``) and ``GET /model_info``; both are open
paths, like ``/health`` (``access.OPEN_PATHS``). ``--worker-name`` names the process in an
``X-Leyline-Worker`` header on every response, which the router passes through to the
client, so a client can count which worker answered.
"""

from __future__ import annotations

import os
import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fastapi import APIRouter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

WORKER_HEADER = "X-Leyline-Worker"
WORKER_NAME_ENV = "LEYLINE_WORKER_NAME"
"""Names a plugin's server process (SGLang), as ``--worker-name`` does ``leyline serve``."""
_WORKER_NAME = re.compile(r"[!-~]{1,128}")  # visible ASCII: a header value as it is


def checked_worker_name(name: str, what: str = "a worker name") -> str:
    """``name`` if it can be sent as a header value as it is; else ``ValueError``."""
    if not _WORKER_NAME.fullmatch(name):
        raise ValueError(f"{what} must be 1-128 visible ASCII characters (no spaces), not {name!r}")
    return name


def worker_name_from_env() -> str | None:
    """``LEYLINE_WORKER_NAME``, checked; None when unset or empty."""
    name = os.environ.get(WORKER_NAME_ENV)
    return checked_worker_name(name, WORKER_NAME_ENV) if name else None


def leyline_version() -> str:
    """The installed ``leyline`` package's version (``unknown`` when run from a bare tree)."""
    try:
        return version("leyline")
    except PackageNotFoundError:
        return "unknown"


def model_path(model: str, loaded_name: str) -> str:
    """The model's path as a worker reports it: the file or directory ``--model`` named
    (absolute), else the loaded model's own name (the embedded SmolLM2, a test model)."""
    path = Path(model).expanduser()
    return str(path.resolve()) if path.exists() else loaded_name


def worker_info_router(served_model_name: str, path: str) -> APIRouter:
    """``GET /server_info`` and ``GET /model_info``, in the shapes sglang-router reads."""
    router = APIRouter(tags=["Operations"])
    server = {
        "served_model_name": served_model_name,
        "model_path": path,
        "dp_size": 1,  # one engine per process; a router spreads load over processes
        "version": leyline_version(),
    }
    model = {"model_path": path, "is_generation": True}

    @router.get("/server_info")
    async def server_info() -> dict[str, object]:
        return dict(server)

    @router.get("/model_info")
    async def model_info() -> dict[str, object]:
        return dict(model)

    return router


class WorkerName:
    """Add ``X-Leyline-Worker: NAME`` to every response (pure ASGI middleware: a streamed
    answer carries it in its head like any other; the body passes through untouched)."""

    def __init__(self, app: ASGIApp, *, name: str) -> None:
        self.app = app
        self.header = (WORKER_HEADER.lower().encode("latin-1"), name.encode("latin-1"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [*message.get("headers", ()), self.header]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, named)
