"""A real ``leyline serve`` in a child process, with two tenants (``--api-keys-file``).

A child process rather than the demo's in-process server: the eval's client threads then
do not share the server's interpreter lock, so /health latency is the server's own.
"""

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

KEYS = {"alpha": "alpha-key-robustness-0123", "bravo": "bravo-key-robustness-0123"}


@dataclass(frozen=True, slots=True)
class ServerLimits:
    max_session_tokens: int = 1024
    """Small, so that a prompt at the limit (a fuzz case) costs one short prefill."""
    max_directives: int = 8
    max_replacement_tokens: int = 64
    max_body_bytes: int = 256 * 1024
    max_sessions: int = 256
    max_new_tokens: int = 8


@dataclass(frozen=True, slots=True)
class Served:
    base_url: str
    """The server root (no ``/v1``)."""
    keys: dict[str, str]
    limits: ServerLimits
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def serve(folder: Path, limits: ServerLimits, model: str = "smollm2") -> Iterator[Served]:
    """Start the server (its log in ``folder/serve.log``), wait for /health, stop it after."""
    keys_file = folder / "api-keys.txt"
    keys_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    port, log = _free_port(), folder / "serve.log"
    command = [
        sys.executable, "-m", "leyline.cli.main", "serve", "--model", model,
        "--host", "127.0.0.1", "--port", str(port), "--api-keys-file", str(keys_file),
        "--max-session-tokens", str(limits.max_session_tokens),
        "--max-directives", str(limits.max_directives),
        "--max-replacement-tokens", str(limits.max_replacement_tokens),
        "--max-body-bytes", str(limits.max_body_bytes),
        "--max-sessions", str(limits.max_sessions),
        "--max-new-tokens", str(limits.max_new_tokens),
        "--log-level", "warning",
    ]  # fmt: skip
    with log.open("wb") as sink:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        _wait(process, base, log)
        yield Served(base, dict(KEYS), limits, log)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def _wait(process: subprocess.Popen[bytes], base: str, log: Path) -> None:
    deadline = time.monotonic() + 300
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"leyline serve exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"leyline serve did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
