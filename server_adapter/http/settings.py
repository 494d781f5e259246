"""One config object for ``leyline serve``: model, address, limits, auth, logging."""

from __future__ import annotations

from dataclasses import dataclass

from leyline.protocol import Limits


@dataclass(frozen=True, slots=True)
class ServerSettings:
    model: str = "smollm2"
    """'smollm2' (embedded default), 'tiny-mla-v2'/'tiny-mla-v3' (random), a .gguf or HF dir."""
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    log_level: str = "info"
    max_body_bytes: int = 4 * 1024 * 1024
    max_directives: int = 64
    max_replacement_tokens: int = 4096
    max_session_tokens: int = 8192
    max_sessions: int = 64
    max_cache_bytes: int = 4 * 1024**3
    """Budget for all session caches together; idle sessions are evicted LRU past it."""
    max_new_tokens: int = 256
    """Default completion length when the request names none."""
    served_model_name: str | None = None

    def __post_init__(self) -> None:
        positive = {
            "port": self.port,
            "max_body_bytes": self.max_body_bytes,
            "max_directives": self.max_directives,
            "max_session_tokens": self.max_session_tokens,
            "max_sessions": self.max_sessions,
            "max_cache_bytes": self.max_cache_bytes,
            "max_new_tokens": self.max_new_tokens,
        }
        for name, value in positive.items():
            if value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.max_replacement_tokens < 0:
            raise ValueError("max_replacement_tokens must not be negative")
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} is not in 1..65535")

    @property
    def limits(self) -> Limits:
        return Limits(
            max_directives=self.max_directives,
            max_replacement_tokens=self.max_replacement_tokens,
            max_session_tokens=self.max_session_tokens,
            max_sessions=self.max_sessions,
        )
