"""The real `leyline serve` (SmolLM2 on CPU) in this process on a loopback port, per module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="module")
def leyline_url() -> Iterator[str]:
    """The OpenAI base URL (``http://127.0.0.1:PORT/v1``) of a real `leyline serve`."""
    from leyline.evals.demo.server import EmbeddedServer

    with EmbeddedServer("smollm2", max_new_tokens=8) as server:
        yield server.base_url
