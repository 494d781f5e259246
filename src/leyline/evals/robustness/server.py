"""A real ``leyline serve`` in a child process, with two tenants (``--api-keys-file``).

A child process rather than the demo's in-process server: the eval's client threads then
do not share the server's interpreter lock, so /health latency is the server's own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from leyline.evals.serve_process import serve_process

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


@contextmanager
def serve(folder: Path, limits: ServerLimits, model: str = "smollm2") -> Iterator[Served]:
    """Start the server (its log in ``folder/serve.log``), wait for /health, stop it after."""
    keys_file = folder / "api-keys.txt"
    keys_file.write_text("".join(f"{tenant} {key}\n" for tenant, key in KEYS.items()))
    options = [
        "--model", model, "--api-keys-file", str(keys_file),
        "--max-session-tokens", str(limits.max_session_tokens),
        "--max-directives", str(limits.max_directives),
        "--max-replacement-tokens", str(limits.max_replacement_tokens),
        "--max-body-bytes", str(limits.max_body_bytes),
        "--max-sessions", str(limits.max_sessions),
        "--max-new-tokens", str(limits.max_new_tokens),
        "--log-level", "warning",
    ]  # fmt: skip
    log = folder / "serve.log"
    with serve_process(log, options) as running:
        yield Served(running.base_url, dict(KEYS), limits, log)
