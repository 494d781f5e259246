"""LangChain on a Leyline server (``pip install 'leyline[langchain]'``).

``leyline_chat_openai(model, base_url, policy=...)`` is a ``langchain_openai.ChatOpenAI``
whose clients are Leyline's: :class:`~leyline.policies.LeylineOpenAI` for ``invoke`` /
``stream``, :class:`~leyline.policies.AsyncLeylineOpenAI` for ``ainvoke`` / ``astream``.
What ChatOpenAI needs of them, and the limits, are in docs/frameworks/langchain.md.
``langchain_openai`` is imported when :func:`leyline_chat_openai` is called, never at import.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import openai

from ..middleware import LeylineOpenAI
from ..middleware_async import AsyncLeylineOpenAI
from ..registry import PolicyConfig

if TYPE_CHECKING:
    from langchain_openai import ChatOpenAI

__all__ = [
    "AsyncLeylineCompletions",
    "LeylineCompletions",
    "leyline_chat_openai",
    "leyline_clients_of",
]

_MISSING = "LangChain's OpenAI models are not installed: pip install 'leyline[langchain]'"


class RawCompletion:
    """What LangChain reads of openai's raw response: ``parse()`` gives the completion
    (or, with ``stream=True``, the wrapper's stream)."""

    def __init__(self, parsed: Any) -> None:
        self._parsed = parsed

    def parse(self) -> Any:
        return self._parsed


class _RawCreate:
    def __init__(self, wrapper: LeylineOpenAI) -> None:
        self._wrapper = wrapper

    def create(self, **kwargs: Any) -> RawCompletion:
        return RawCompletion(self._wrapper.chat.completions.create(**kwargs))


class _AsyncRawCreate:
    def __init__(self, wrapper: AsyncLeylineOpenAI) -> None:
        self._wrapper = wrapper

    async def create(self, **kwargs: Any) -> RawCompletion:
        return RawCompletion(await self._wrapper.chat.completions.create(**kwargs))


class LeylineCompletions:
    """``client.chat.completions`` for ChatOpenAI: ``create`` and
    ``with_raw_response.create`` both go through the wrapper."""

    def __init__(self, wrapper: LeylineOpenAI) -> None:
        self.wrapper = wrapper
        self.with_raw_response = _RawCreate(wrapper)

    def create(self, **kwargs: Any) -> Any:
        return self.wrapper.chat.completions.create(**kwargs)


class AsyncLeylineCompletions:
    """The async twin of :class:`LeylineCompletions` (ChatOpenAI's ``async_client``)."""

    def __init__(self, wrapper: AsyncLeylineOpenAI) -> None:
        self.wrapper = wrapper
        self.with_raw_response = _AsyncRawCreate(wrapper)

    async def create(self, **kwargs: Any) -> Any:
        return await self.wrapper.chat.completions.create(**kwargs)


def leyline_chat_openai(
    model: str,
    base_url: str | None = None,
    api_key: str = "-",
    policy: PolicyConfig | None = None,
    *,
    client: LeylineOpenAI | None = None,
    async_client: AsyncLeylineOpenAI | None = None,
    leyline: Mapping[str, Any] | None = None,
    **chat_options: Any,
) -> ChatOpenAI:
    """A ``ChatOpenAI`` for ``model`` on Leyline wrappers.

    ``base_url`` is the server's OpenAI base URL (``http://127.0.0.1:8000/v1``). The wrappers
    are ``client`` / ``async_client`` when given, else new ones around ``openai.OpenAI`` /
    ``openai.AsyncOpenAI(base_url, api_key)`` with ``policy`` and the wrapper options in
    ``leyline`` (``counter``, ``directives``, ``max_conversations``, ...). ``chat_options``
    go to ``ChatOpenAI`` (``temperature``, ``max_tokens``, ``streaming``, ...). The wrappers
    (their ``records``, ``close()``) are :func:`leyline_clients_of` the model.

    Raises ``ValueError`` without ``base_url`` where a wrapper must be made, ``ImportError``
    without ``langchain-openai``.
    """
    try:
        from langchain_openai import ChatOpenAI
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_MISSING) from exc
    options = dict(leyline or {})
    if (client is None or async_client is None) and base_url is None:
        raise ValueError("give base_url (the server's /v1 URL) or both wrappers")
    if client is None:
        client = LeylineOpenAI(openai.OpenAI(base_url=base_url, api_key=api_key), policy, **options)
    if async_client is None:
        async_client = AsyncLeylineOpenAI(
            openai.AsyncOpenAI(base_url=base_url, api_key=api_key), policy, **options
        )
    return ChatOpenAI(
        model=model,
        api_key=client.api_key,
        base_url=str(client.base_url),
        client=LeylineCompletions(client),
        async_client=AsyncLeylineCompletions(async_client),
        root_client=client,
        root_async_client=async_client,
        use_responses_api=False,
        **chat_options,
    )


def leyline_clients_of(model: ChatOpenAI) -> tuple[LeylineOpenAI, AsyncLeylineOpenAI]:
    """The sync and async wrappers of a model made by :func:`leyline_chat_openai`.
    Raises ``TypeError`` for a model whose clients are not Leyline's."""
    sync, async_ = getattr(model, "client", None), getattr(model, "async_client", None)
    if not isinstance(sync, LeylineCompletions) or not isinstance(async_, AsyncLeylineCompletions):
        raise TypeError(f"{type(model).__name__} has no Leyline clients")
    return sync.wrapper, async_.wrapper
