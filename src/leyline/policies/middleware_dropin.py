"""What makes a wrapper a drop-in for the OpenAI client it wraps: the client's settings read
through, and every attribute the wrapper does not define (``models``, ``embeddings``, ...)
taken from the client."""

from __future__ import annotations

from typing import Any


class ClientDropIn:
    client: Any
    """The wrapped ``openai.OpenAI`` or ``openai.AsyncOpenAI``."""

    @property
    def base_url(self) -> Any:
        return self.client.base_url

    @property
    def api_key(self) -> str:
        return str(self.client.api_key)

    @property
    def organization(self) -> str | None:
        return self.client.organization  # type: ignore[no-any-return]

    @property
    def project(self) -> str | None:
        return self.client.project  # type: ignore[no-any-return]

    @property
    def timeout(self) -> Any:
        return self.client.timeout

    @property
    def max_retries(self) -> int:
        return int(self.client.max_retries)

    def __getattr__(self, name: str) -> Any:
        """Everything else is the wrapped client's."""
        if name.startswith("__") or "client" not in self.__dict__:
            raise AttributeError(name)
        return getattr(self.__dict__["client"], name)
