"""Next-token choice (greedy or sampled) and the conditions that end a generation."""

from __future__ import annotations

import torch

from leyline.core.turns import SamplingParams


def torch_generator(params: SamplingParams) -> torch.Generator | None:
    """The seeded generator a sampled generation draws from (None: torch's global one)."""
    if params.seed is None:
        return None
    return torch.Generator().manual_seed(params.seed)


def choose_token(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> int:
    """One token id from fp32 next-token ``logits`` ``[vocab]``."""
    if params.temperature == 0:
        return int(torch.argmax(logits))
    scores = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < scores.numel():
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p is not None and params.top_p < 1:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        scores = scores.scatter(0, order, sorted_scores.masked_fill(drop, float("-inf")))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs.cpu(), 1, generator=generator))


def token_logprobs(
    logits: torch.Tensor, token: int, top: int
) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-probability of ``token`` and the ``top`` most likely (token, logprob) pairs."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    best = torch.topk(logp, top) if top else None
    alternatives = (
        ()
        if best is None
        else tuple((int(i), float(v)) for v, i in zip(best.values, best.indices, strict=True))
    )
    return float(logp[token]), alternatives


def find_stop(text: str, stops: tuple[str, ...]) -> int | None:
    """Index in ``text`` where the earliest stop string starts, or None."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None
