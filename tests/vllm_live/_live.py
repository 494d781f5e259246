"""The vLLM dialect of the live helpers (the rest is tests/sglang_live/_live.py's): vLLM's
own completions route for plain requests, and what the reference engine computes for the
KV the vLLM backend builds."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx
import torch

from leyline.protocol.algebra import Edit
from tests.sglang_live._live import TOP, Generated

if TYPE_CHECKING:
    from leyline.engine.engine import Engine


def generate(server: httpx.Client, tokens: Sequence[int], **extra: Any) -> Generated:
    """vLLM's own ``/v1/completions`` (no ``leyline`` object), one greedy token, top-20
    logprobs keyed by token id; cached tokens from the usage details."""
    body = {
        "prompt": list(tokens), "max_tokens": 1, "temperature": 0, "logprobs": TOP,
        "return_tokens_as_token_ids": True, **extra,
    }  # fmt: skip
    reply = server.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    out = reply.json()
    top = {
        int(key.removeprefix("token_id:")): float(logprob)
        for key, logprob in out["choices"][0]["logprobs"]["top_logprobs"][0].items()
    }
    usage = out["usage"]
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    return Generated(top, cached, int(usage["prompt_tokens"]))


def reference_built(engine: Engine, old: Sequence[int], edit: Edit, block: int) -> torch.Tensor:
    """The reference engine's next-token logprobs for what the vLLM backend builds for
    ``edit`` on a session prefilled with ``old`` (float64). vLLM caches full blocks only, so
    the kept tokens of ``old``'s last partial block have no source and are computed afresh,
    and so are the kept tokens after a replacement up to the end of its block (the request
    computing it runs to a block boundary). The reference computes a kept token afresh when
    it is replaced, but a replacement by the same tokens is no edit to it: so those tokens
    are replaced by stand-ins first, then by themselves."""
    from leyline.engine.session import SessionCache

    n_old = len(old)
    tail = n_old - n_old % block  # old positions from here on: never cached
    shift = len(edit.replacement) - (edit.end - edit.start)
    end = edit.end  # the kept tokens old[edit.end:end] are computed with the replacement
    if edit.replacement:
        run_end = edit.start + len(edit.replacement)
        rounded = -(-run_end // block) * block
        # Past the sequence, the whole sequence's request computes everything after it.
        end = n_old if rounded >= n_old + shift else min(n_old, edit.end + rounded - run_end)
    fresh = [(edit.end, n_old)] if end >= tail else [(edit.end, end), (tail, n_old)]

    def stand_in(a: int, b: int) -> tuple[int, ...]:
        return tuple(t ^ 1 for t in old[a:b])

    first = Edit(edit.start, fresh[0][1], (*edit.replacement, *stand_in(*fresh[0])))
    stand_ins = [first] + [Edit(a, b, stand_in(a, b)) for a, b in fresh[1:] if b > a]
    actual = [Edit(a + shift, b + shift, tuple(old[a:b])) for a, b in fresh if b > a]
    session = SessionCache(engine)
    session.prefill(old)
    session.apply_edits(stand_ins)
    if actual:
        session.apply_edits(actual)
    return torch.log_softmax(session.next_token_logits().double(), -1)
