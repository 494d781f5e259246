"""The shell of the in-process Leyline servers the conformance tests run against: an
``httpx.MockTransport`` handler whose ``_route`` raises protocol errors, answered as the
protocol's error body."""

from __future__ import annotations

import httpx

from leyline.protocol import LeylineError


class FakeServerBase:
    def __call__(self, request: httpx.Request) -> httpx.Response:
        try:
            return self._route(request)
        except LeylineError as exc:
            return httpx.Response(exc.http_status, content=exc.to_body().model_dump_json())

    def _route(self, request: httpx.Request) -> httpx.Response:
        raise NotImplementedError
