"""The requests the vLLM backend runs itself: one ``EngineClient.generate`` each, in a cache
namespace (``cache_salt``), carrying the backend's order as ``kv_hints``.

:class:`Runner` is what ``VllmBackend`` needs (tests give it a fake); :class:`EngineRunner`
is the real one over the API server's ``EngineClient`` (vLLM imported only when it runs).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from leyline.core.salted_session import new_private_salt
from leyline.core.turns import FinishReason, OnToken, SamplingParams, TokenChoice
from leyline.vllm.link import Answer, Order

PREFILL = SamplingParams(max_new_tokens=1, temperature=0.0)
"""A request that only makes vLLM compute (and cache) its prompt."""

CARRIER = (0,)
"""The prompt of a request that only carries an order (a purge or a release)."""


def carrier_salt() -> str:
    """A namespace of its own for a carrier request: it shares no block with anyone."""
    return new_private_salt()


@dataclass(frozen=True, slots=True)
class Ran:
    """What one request gave back."""

    ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    cached_tokens: int
    """vLLM's ``num_cached_tokens``: its prefix hit plus the rows the connector loaded."""
    answer: Answer | None
    """The connector's answer to the request's order (None: it carried none)."""
    logprobs: tuple[TokenChoice, ...] = ()


class Runner(Protocol):
    async def run(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        salt: str | None,
        order: Order | None = None,
        on_token: OnToken | None = None,
    ) -> Ran:
        """Run ``tokens`` as a prompt under ``salt``; stopped early (aborted) when
        ``on_token`` says so."""
        ...


def vllm_sampling(params: SamplingParams) -> Any:
    """Leyline's checked sampling fields as vLLM's ``SamplingParams`` (deltas streamed)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        max_tokens=params.max_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p if params.top_p is not None else 1.0,
        top_k=params.top_k if params.top_k is not None else 0,
        seed=params.seed,
        stop=list(params.stop) or None,
        stop_token_ids=list(params.stop_token_ids or ()) or None,
        logprobs=params.logprobs,
        output_kind=RequestOutputKind.DELTA,
    )


def _choices(logprobs: Any, ids: Sequence[int]) -> list[TokenChoice]:
    """vLLM's per-token ``{id: Logprob}`` dicts as Leyline's token choices."""
    out = []
    for token, top in zip(ids, logprobs or (), strict=False):
        ranked = sorted(top.items(), key=lambda item: item[1].rank or 0)
        chosen = top.get(token)
        out.append(
            TokenChoice(
                int(token),
                float(chosen.logprob) if chosen is not None else float("-inf"),
                tuple((int(t), float(lp.logprob)) for t, lp in ranked if lp.rank),
            )
        )
    return out


class EngineRunner:
    """``Runner`` over the API server's ``EngineClient`` (an ``AsyncLLM``)."""

    def __init__(self, engine_client: Any) -> None:
        self.engine = engine_client

    async def run(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        salt: str | None,
        order: Order | None = None,
        on_token: OnToken | None = None,
    ) -> Ran:
        from vllm.inputs import TokensPrompt

        from leyline.vllm.connector import order_hints

        prompt = TokensPrompt(prompt_token_ids=list(tokens))
        if salt is not None:
            prompt["cache_salt"] = salt
        request_id = f"leyline-{uuid.uuid4().hex}"
        hints = None if order is None else order_hints(order)
        ids: list[int] = []
        pieces: list[str] = []
        choices: list[TokenChoice] = []
        finish: str | None = None
        cached = 0
        params_out: dict[str, Any] | None = None
        stopped = False
        stream = self.engine.generate(prompt, vllm_sampling(params), request_id, kv_hints=hints)
        async for out in stream:
            cached = int(out.num_cached_tokens or cached)
            params_out = out.kv_transfer_params or params_out
            completion = out.outputs[0]
            new = [int(t) for t in completion.token_ids]
            ids.extend(new)
            pieces.append(completion.text or "")
            choices.extend(_choices(completion.logprobs, new))
            finish = completion.finish_reason or finish
            if on_token is not None and not all(on_token(t) for t in new):
                stopped = True
                break
        if stopped:
            await stream.aclose()
            await self.engine.abort(request_id)
        return Ran(
            ids=tuple(ids),
            text="".join(pieces),
            finish_reason="length" if finish == "length" else "stop",
            cached_tokens=cached,
            answer=Answer.from_params(params_out),
            logprobs=tuple(choices) if params.logprobs is not None else (),
        )
