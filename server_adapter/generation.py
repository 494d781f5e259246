"""The decode loop: sample token by token into one buffer sized for the whole generation.

transformers' ``DynamicCache`` copies the whole cache at every decode step; here each step
writes its entry in place (``forward_into``), so a step costs the model, not the cache size.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from leyline.protocol.errors import ErrorCode, LeylineError

from .forward import filled, new_buffers
from .reports import TokenChoice
from .sampling import FinishReason, SamplingParams, choose_token, find_stop, token_logprobs
from .session_state import SessionState

if TYPE_CHECKING:
    from .engine import Engine

OnToken = Callable[[int], bool]
"""Called with each generated token; returning False stops the generation."""


def decode_loop(
    engine: Engine, state: SessionState, params: SamplingParams, on_token: OnToken | None
) -> tuple[SessionState, list[int], list[TokenChoice], FinishReason, int | None]:
    """Generate after ``state`` (which must have logits). Returns the new state (revision + 1,
    the last token pending), the tokens, their logprobs, the finish reason and where a stop
    string starts in the decoded text (or None)."""
    n0 = len(state.tokens)
    budget = params.max_new_tokens
    cap = engine.limits.max_session_tokens
    if cap is not None:
        if n0 >= cap:
            raise LeylineError(
                ErrorCode.session_too_long,
                f"the session holds {n0} tokens, the most this model takes: nothing "
                "can be generated; edit or forget part of it first",
            )
        budget = min(budget, cap - n0)
    stops = set(params.stop_token_ids or engine.loaded.eos_token_ids)
    buffers = new_buffers(state.kv, n0 + budget - 1)  # the last token stays pending
    for layer, slots in zip(state.kv, buffers, strict=True):
        for src, dst in zip(layer, slots, strict=True):
            dst[..., :n0, :].copy_(src)
    generator, logits, length = params.generator(), state.logits, n0
    assert logits is not None
    out: list[int] = []
    choices: list[TokenChoice] = []
    finish: FinishReason = "length"
    cut: int | None = None
    for step in range(budget):
        token = choose_token(logits, params, generator)
        out.append(token)
        if params.logprobs is not None:
            choices.append(TokenChoice(token, *token_logprobs(logits, token, params.logprobs)))
        if on_token is not None and on_token(token) is False:
            finish = "stop"
            break
        if token in stops:
            finish = "stop"
            break
        if params.stop:
            cut = find_stop(engine.decode(out), params.stop)
            if cut is not None:
                finish = "stop"
                break
        if step + 1 == budget:
            break
        logits = engine.forward_into(buffers, length, [token])
        length += 1
    kv = filled(buffers, length)
    exact = length if state.exact_length == n0 else state.exact_length
    new = SessionState(state.tokens + tuple(out), kv, None, state.revision + 1, state.spans, exact)
    return new, out, choices, finish, cut
