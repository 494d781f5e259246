"""A real `leyline serve` (SmolLM2, CPU) on a loopback port, started once for these tests."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from leyline.evals.serve_process import serve_process

API_KEY = "test-key"
MAX_DIRECTIVES = 8
MAX_BODY = 200_000


@dataclass(frozen=True)
class Server:
    base_url: str
    process: subprocess.Popen[bytes]

    def client(self, **kwargs: object) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url,
            timeout=120,
            headers={"Authorization": f"Bearer {API_KEY}"},
            **kwargs,
        )  # type: ignore[arg-type]


@contextmanager
def serve(log: Path, *options: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """``leyline serve`` with ``options`` (and ``env`` on top of ours) on a free port, its
    output in ``log``; stopped on exit. Raises if it exits or does not answer ``/health``
    within 5 minutes."""
    with serve_process(log, ["--api-key", API_KEY, *options], env=env, stop_timeout_s=20) as p:
        yield Server(p.base_url, p.process)


def _test_server(
    tmp_path_factory: pytest.TempPathFactory, name: str, env: dict[str, str] | None = None
) -> Iterator[Server]:
    """The server these tests share: 8 new tokens, ``MAX_DIRECTIVES``, ``MAX_BODY``."""
    log = tmp_path_factory.mktemp(name) / "serve.log"
    options = ["--max-new-tokens", "8", "--max-directives", str(MAX_DIRECTIVES)]
    options += ["--max-body-bytes", str(MAX_BODY), "--max-sessions", "48"]
    with serve(log, *options, "--log-level", "warning", env=env) as running:
        yield running


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    yield from _test_server(tmp_path_factory, "server")


@pytest.fixture(scope="session")
def copy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same server with in-place edits off (``LEYLINE_IN_PLACE_EDITS=0``: every splice
    builds a new KV, the path of forks and MLA models, docs/engine.md)."""
    yield from _test_server(tmp_path_factory, "server-copy", {"LEYLINE_IN_PLACE_EDITS": "0"})
