"""A stand-in for vLLM's API server app with the endpoint plugin attached: vLLM's own
completions route echoes the body it got, so a test sees what reached vLLM; and one
request through it."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from fastapi import FastAPI

from leyline.vllm.endpoint import LeylineEndpoint


def stand_in_app() -> tuple[FastAPI, LeylineEndpoint]:
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict[str, Any]) -> dict[str, Any]:
        return {"vllm": body}

    endpoint = LeylineEndpoint()
    endpoint.attach_router(app)
    return app, endpoint


def call(
    app: FastAPI, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> httpx.Response:
    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://x") as client:
            return await client.request(method, path, json=body, headers=headers or {})

    return asyncio.run(send())
