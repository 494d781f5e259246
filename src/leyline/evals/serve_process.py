"""``leyline serve`` in a child process on a free loopback port, for evals and tests: started,
waited for on ``/health``, stopped on exit."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, slots=True)
class ServeProcess:
    base_url: str
    """The server root (no ``/v1``)."""
    process: subprocess.Popen[bytes]


@contextmanager
def serve_process(
    log: Path,
    options: list[str],
    *,
    env: Mapping[str, str] | None = None,
    ready_timeout_s: float = 300,
    stop_timeout_s: float = 30,
) -> Iterator[ServeProcess]:
    """``leyline serve OPTIONS`` (its output in ``log``, ``env`` on top of ours); raises
    with the log's tail if it exits or does not answer ``/health`` in time."""
    port = free_port()
    command = serve_command(port, options)
    with log.open("wb") as sink:
        process = subprocess.Popen(
            command,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(process, base, log, ready_timeout_s)
        yield ServeProcess(base, process)
    finally:
        process.terminate()
        try:
            process.wait(timeout=stop_timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()


def serve_command(port: int, options: list[str]) -> list[str]:
    """The command line of ``leyline serve OPTIONS`` on ``127.0.0.1:port`` (this Python)."""
    command = [sys.executable, "-m", "leyline.cli.main", "serve"]
    return [*command, "--host", "127.0.0.1", "--port", str(port), *options]


def wait_healthy(
    process: subprocess.Popen[bytes],
    base: str,
    log: Path,
    timeout: float,
    paths: tuple[str, ...] = ("/health",),
) -> None:
    """Wait until each of ``paths`` under ``base`` answers 200, in turn; raises with
    ``log``'s tail if ``process`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    waiting = list(paths)
    while waiting:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{base}{waiting[0]}", timeout=2).status_code == 200:
                waiting.pop(0)
                continue
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the server did not answer {waiting[0]} in {timeout:g} s:\n"
                f"{log.read_text()[-3000:]}"
            )
        time.sleep(0.5)
