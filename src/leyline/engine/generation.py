"""The decode loop: sample token by token into one buffer sized for the whole generation.

transformers' ``DynamicCache`` copies the whole cache at every decode step; here each step
writes its entry in place (``forward_into``), so a step costs the model, not the cache size.

A :class:`Decoder` is one generation as a state machine (choose a token, then feed it), so a
scheduler can step many at once in one batched forward (``batched_decode``, ``scheduler``);
:func:`decode_loop` drives one alone.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from leyline.core.turns import FinishReason, SamplingParams, TokenChoice
from leyline.engine.forward import KVBuffers, buffers_holding, filled
from leyline.engine.kv.buffer_views import has_room, resized
from leyline.engine.sampling import choose_token, find_stop, token_logprobs, torch_generator
from leyline.engine.session_state import SessionState
from leyline.protocol.errors import ErrorCode, LeylineError

if TYPE_CHECKING:
    from leyline.engine.engine import Engine

OnToken = Callable[[int], bool]
"""Called with each generated token; returning False stops the generation."""


@dataclass(frozen=True, slots=True)
class Decoded:
    """A finished generation: the new state (revision + 1, the last token pending), the
    tokens, their logprobs, the finish reason and where a stop string starts in the decoded
    text (or None)."""

    state: SessionState
    tokens: list[int]
    choices: list[TokenChoice]
    finish: FinishReason
    cut: int | None


class Decoder:
    """One generation after ``state`` (which must have logits), one token at a time.

    ``choose()`` samples from the current logits and says whether the generation goes on;
    if it does, the caller runs the chosen token (:attr:`pending`) at position
    :attr:`length` of :attr:`buffers` and hands the logits to ``advance()``. ``result()``
    ends it. The buffers are the generation's own: the state's KV is only read.

    ``in_place``: the caller owns the state's buffers and lends them; where they have room
    for the whole budget, the decoder writes past the state's KV in them (never before it)
    instead of copying the cache into new ones (:attr:`in_place` says which it did).
    """

    def __init__(
        self,
        engine: Engine,
        state: SessionState,
        params: SamplingParams,
        on_token: OnToken | None,
        *,
        in_place: bool = False,
    ) -> None:
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
        if state.logits is None:
            raise ValueError("a generation starts from a state with next-token logits")
        self.engine, self.state, self.params, self.on_token = engine, state, params, on_token
        self.budget = budget
        self.stops = set(params.stop_token_ids or engine.loaded.eos_token_ids)
        need = n0 + budget - 1  # the last token stays pending
        room = in_place and state.kv_length == n0 and has_room(state.kv, need)
        self.in_place = room
        self.buffers: KVBuffers
        if room:
            self.buffers = [[resized(t, need) for t in layer] for layer in state.kv]
        else:
            self.buffers = buffers_holding(state.kv, need)
        self.generator = torch_generator(params)
        self.logits: torch.Tensor = state.logits
        self.length = n0
        self.out: list[int] = []
        self.choices: list[TokenChoice] = []
        self.finish: FinishReason = "length"
        self.cut: int | None = None
        self.done = False

    @property
    def tokens_left(self) -> int:
        """Tokens it may still produce (its budget; a stop may end it sooner)."""
        return 0 if self.done else self.budget - len(self.out)

    @property
    def pending(self) -> int:
        """The last chosen token, the one the next forward runs."""
        return self.out[-1]

    def choose(self) -> bool:
        """Sample the next token from the current logits; False once the generation ends
        (a stop token or string, the budget, or ``on_token`` saying stop)."""
        if self.done:
            return False
        token = choose_token(self.logits, self.params, self.generator)
        self.out.append(token)
        if self.params.logprobs is not None:
            top = token_logprobs(self.logits, token, self.params.logprobs)
            self.choices.append(TokenChoice(token, *top))
        stopped = self.on_token is not None and self.on_token(token) is False
        if stopped or token in self.stops:
            self.finish, self.done = "stop", True
        elif self.params.stop:
            self.cut = find_stop(self.engine.decode(self.out), self.params.stop)
            if self.cut is not None:
                self.finish, self.done = "stop", True
        if not self.done and len(self.out) == self.budget:
            self.done = True
        return not self.done

    def advance(self, logits: torch.Tensor) -> None:
        """The logits after :attr:`pending`, whose KV is now at :attr:`length`."""
        self.logits = logits
        self.length += 1

    def result(self, *, owns_kv: bool = True) -> Decoded:
        """The state after the generation; ``owns_kv``: whether nobody else holds its
        buffers (always true of a copy; of lent buffers, as long as the lender was not
        forked meanwhile)."""
        state = self.state
        n0 = len(state.tokens)
        kv = filled(self.buffers, self.length)
        exact = self.length if state.exact_length == n0 else state.exact_length
        new = SessionState(
            state.tokens + tuple(self.out),
            kv,
            None,
            state.revision + 1,
            state.spans,
            exact,
            owns_kv=owns_kv or not self.in_place,
        )
        return Decoded(new, self.out, self.choices, self.finish, self.cut)


def decode_loop(
    engine: Engine, state: SessionState, params: SamplingParams, on_token: OnToken | None
) -> Decoded:
    """Generate after ``state`` alone, one forward per token."""
    decoder = Decoder(engine, state, params, on_token)
    while decoder.choose():
        decoder.advance(engine.forward_into(decoder.buffers, decoder.length, [decoder.pending]))
    return decoder.result()
