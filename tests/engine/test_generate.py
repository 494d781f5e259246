"""Generation on a tiny random model: greedy equals argmax of fresh forwards, stop rules,
and the pending last token across edits."""

from __future__ import annotations

import pytest
import torch

from leyline.core.turns import SamplingParams
from leyline.engine.engine import Engine
from leyline.engine.sampling import choose_token, torch_generator
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode

from ._helpers import random_tokens, rel_err


def test_greedy_generation_equals_argmax_of_fresh_prefills(llama_engine: Engine) -> None:
    tokens = random_tokens(20, llama_engine.vocab_size, seed=1)
    session = SessionCache(llama_engine)
    session.prefill(tokens)
    out = session.generate(SamplingParams(max_new_tokens=6, stop_token_ids=(-1,)))
    seq = list(tokens)
    for _ in range(6):
        seq.append(int(torch.argmax(llama_engine.forward((), seq)[1])))
    assert list(out.tokens) == seq[20:] and out.finish_reason == "length"
    assert session.tokens == tuple(seq)
    assert session.state.kv_length == len(seq) - 1  # the last sampled token is pending


def test_a_stop_token_ends_generation_and_stays_in_the_session(llama_engine: Engine) -> None:
    tokens = random_tokens(20, llama_engine.vocab_size, seed=2)
    session = SessionCache(llama_engine)
    session.prefill(tokens)
    first = int(torch.argmax(session.next_token_logits()))
    out = session.generate(SamplingParams(max_new_tokens=5, stop_token_ids=(first,)))
    assert out.tokens == (first,) and out.finish_reason == "stop"
    assert session.tokens[-1] == first


def test_edits_after_generation_complete_the_pending_token(llama_engine: Engine) -> None:
    tokens = random_tokens(30, llama_engine.vocab_size, seed=3)
    session = SessionCache(llama_engine)
    session.prefill(tokens)
    session.generate(SamplingParams(max_new_tokens=3, stop_token_ids=(-1,)))
    session.apply_edits([Edit(5, 10, (), Mode.amortize)])
    assert session.state.kv_length == len(session.tokens)
    session.apply_edits([Edit(2, 4, (9,), Mode.forget)])
    fresh = llama_engine.forward((), session.tokens)[1]
    assert rel_err(session.next_token_logits(), fresh) <= 1e-5


def test_sampling_is_seeded_and_top_k_one_is_greedy() -> None:
    logits = torch.randn(100)
    params = SamplingParams(temperature=1.0, seed=3)
    draws = [choose_token(logits, params, torch_generator(params)) for _ in range(2)]
    assert draws[0] == draws[1]
    one = SamplingParams(temperature=2.0, top_k=1, seed=0)
    assert choose_token(logits, one, torch_generator(one)) == int(torch.argmax(logits))
    nucleus = SamplingParams(temperature=1.0, top_p=1e-6, seed=0)
    assert choose_token(logits, nucleus, torch_generator(nucleus)) == int(torch.argmax(logits))


@pytest.mark.parametrize(
    "bad", [{"max_new_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_k": 0}]
)
def test_invalid_sampling_params_are_rejected(bad: dict) -> None:
    with pytest.raises(ValueError):
        SamplingParams(**bad)


def test_logprobs_and_cancellation(llama_engine: Engine) -> None:
    tokens = random_tokens(20, llama_engine.vocab_size, seed=4)
    session = SessionCache(llama_engine)
    session.prefill(tokens)
    fresh = torch.log_softmax(llama_engine.forward((), tokens)[1].double(), -1)
    seen: list[int] = []
    out = session.generate(
        SamplingParams(max_new_tokens=8, stop_token_ids=(-1,), logprobs=3),
        on_token=lambda t: seen.append(t) or len(seen) < 2,  # cancel after the second token
    )
    assert out.finish_reason == "stop" and len(out.tokens) == 2 and seen == list(out.tokens)
    first = out.logprobs[0]
    assert first.token == out.tokens[0] and len(first.top) == 3
    assert abs(first.logprob - float(fresh[first.token])) < 1e-5
    assert first.top[0] == (first.token, first.logprob)  # greedy picks the most likely
