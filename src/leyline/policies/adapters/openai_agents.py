"""The OpenAI Agents SDK on a Leyline server (``pip install 'leyline[agents]'``).

The SDK's Chat Completions model (``OpenAIChatCompletionsModel``) gets an
:class:`~leyline.policies.AsyncLeylineOpenAI` as its client: ``leyline_agents_model`` for
``Agent(model=...)``, ``use_leyline_by_default`` to make it the SDK's default. What the SDK
reads of the client and how the wrapper answers are in docs/frameworks/openai-agents.md.
The ``agents`` package is imported when a function here is called, never at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import openai

from ..middleware_async import AsyncLeylineOpenAI
from ..registry import PolicyConfig

if TYPE_CHECKING:
    from agents import OpenAIChatCompletionsModel

__all__ = [
    "leyline_agents_client",
    "leyline_agents_model",
    "leyline_client_of",
    "use_leyline_by_default",
]

_MISSING = "the OpenAI Agents SDK is not installed: pip install 'leyline[agents]' (openai-agents)"


def leyline_agents_client(
    base_url: str | None = None,
    api_key: str = "-",
    policy: PolicyConfig | None = None,
    *,
    client: openai.AsyncOpenAI | AsyncLeylineOpenAI | None = None,
    **options: Any,
) -> AsyncLeylineOpenAI:
    """An :class:`AsyncLeylineOpenAI` for the SDK: around ``client`` when given (an
    ``AsyncLeylineOpenAI`` is returned as it is), else around a new
    ``openai.AsyncOpenAI(base_url=base_url, api_key=api_key)``.

    ``base_url`` is the server's OpenAI base URL (``http://127.0.0.1:8000/v1``); ``policy``
    and ``options`` (``counter``, ``session``, ``directives``, ``max_conversations``, ...) go
    to the wrapper. Raises ``ValueError`` when neither ``base_url`` nor ``client`` is given,
    or when options are given with a ready wrapper.
    """
    if isinstance(client, AsyncLeylineOpenAI):
        if policy is not None or options:
            raise ValueError("policy and options belong to the wrapper already given")
        return client
    if client is None:
        if base_url is None:
            raise ValueError("give base_url (the server's /v1 URL) or client")
        client = openai.AsyncOpenAI(base_url=base_url, api_key=api_key)
    return AsyncLeylineOpenAI(client, policy, **options)


def leyline_agents_model(
    model: str,
    base_url: str | None = None,
    api_key: str = "-",
    policy: PolicyConfig | None = None,
    *,
    client: openai.AsyncOpenAI | AsyncLeylineOpenAI | None = None,
    **options: Any,
) -> OpenAIChatCompletionsModel:
    """An ``OpenAIChatCompletionsModel`` for ``model`` whose client is Leyline's
    (see :func:`leyline_agents_client` for the other arguments).

    ``Agent(name=..., model=leyline_agents_model("smollm2", url, policy="truncate"))``; the
    wrapper is ``model._client`` and its records ``leyline_client_of(model).records``.
    Raises ``ImportError`` without the ``agents`` package.
    """
    try:
        from agents import OpenAIChatCompletionsModel
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_MISSING) from exc
    wrapper = leyline_agents_client(base_url, api_key, policy, client=client, **options)
    return OpenAIChatCompletionsModel(model=model, openai_client=cast(Any, wrapper))


def leyline_client_of(model: OpenAIChatCompletionsModel) -> AsyncLeylineOpenAI:
    """The wrapper inside a model made by :func:`leyline_agents_model` (its ``records``,
    ``aclose()``). Raises ``TypeError`` for a model whose client is not Leyline's."""
    client = getattr(model, "_client", None)
    if not isinstance(client, AsyncLeylineOpenAI):
        raise TypeError(f"{type(model).__name__} has no Leyline client")
    return client


def use_leyline_by_default(
    base_url: str | None = None,
    api_key: str = "-",
    policy: PolicyConfig | None = None,
    *,
    client: openai.AsyncOpenAI | AsyncLeylineOpenAI | None = None,
    **options: Any,
) -> AsyncLeylineOpenAI:
    """Make a Leyline client the SDK's default (``set_default_openai_client``, not used for
    tracing: its key is the Leyline server's) and Chat Completions its default API, so
    ``Agent(model="smollm2")`` runs on Leyline. Returns the wrapper (its ``records``).

    This sets the SDK's process-wide defaults; tracing stays as configured (disable it with
    ``agents.set_tracing_disabled(True)`` or ``RunConfig(tracing_disabled=True)`` where
    nothing can be exported). Raises ``ImportError`` without the ``agents`` package.
    """
    try:
        from agents import set_default_openai_api, set_default_openai_client
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(_MISSING) from exc
    wrapper = leyline_agents_client(base_url, api_key, policy, client=client, **options)
    set_default_openai_client(cast(Any, wrapper), use_for_tracing=False)
    set_default_openai_api("chat_completions")
    return wrapper
