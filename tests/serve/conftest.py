"""A real `leyline serve` (SmolLM2, CPU) on a loopback port, started once for these tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(log: Path, *options: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """``leyline serve`` with ``options`` (and ``env`` on top of ours) on a free port, its
    output in ``log``; stopped on exit. Raises if it exits or does not answer ``/health``
    within 5 minutes."""
    port = _free_port()
    command = [sys.executable, "-m", "leyline.cli.main", "serve", "--port", str(port)]
    command += ["--api-key", API_KEY, *options]
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"leyline serve exited early:\n{log.read_text()}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"leyline serve did not come up:\n{log.read_text()}")
            time.sleep(0.5)
        yield Server(base, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("server") / "serve.log"
    options = ["--max-new-tokens", "8", "--max-directives", str(MAX_DIRECTIVES)]
    options += ["--max-body-bytes", str(MAX_BODY), "--max-sessions", "48"]
    with serve(log, *options, "--log-level", "warning") as running:
        yield running


@pytest.fixture(scope="session")
def copy_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The same server with in-place edits off (``LEYLINE_IN_PLACE_EDITS=0``: every splice
    builds a new KV, the path of forks and MLA models, docs/engine.md)."""
    log = tmp_path_factory.mktemp("server-copy") / "serve.log"
    options = ["--max-new-tokens", "8", "--max-directives", str(MAX_DIRECTIVES)]
    options += ["--max-body-bytes", str(MAX_BODY), "--max-sessions", "48"]
    env = {"LEYLINE_IN_PLACE_EDITS": "0"}
    with serve(log, *options, "--log-level", "warning", env=env) as running:
        yield running
