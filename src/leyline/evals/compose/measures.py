"""How far an arm's next-token logits are from the full recompute's (fp64 throughout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Agreement:
    kl: float
    """KL(full || arm) in nats."""
    cosine: float
    """Raw cosine of the two logit vectors (dominated by their shared mean and scale)."""
    centred_cosine: float
    """Cosine after subtracting each vector's mean over the vocabulary (logits are defined
    up to a constant, so this is the cosine that sees only what softmax sees)."""
    argmax_agrees: bool
    p_answer: float | None
    """The arm's probability of the designated answer token."""
    answer_is_argmax: bool | None
    finite: bool


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a @ b) / (a.norm() * b.norm()).clamp_min(1e-300))


def compare(full: torch.Tensor, arm: torch.Tensor, answer: int | None) -> Agreement:
    f, a = full.double().flatten(), arm.double().flatten()
    finite = bool(torch.isfinite(a).all())
    logp_f, logp_a = torch.log_softmax(f, -1), torch.log_softmax(a, -1)
    kl = float((logp_f.exp() * (logp_f - logp_a)).sum())
    top = int(a.argmax())
    return Agreement(
        kl=kl,
        cosine=_cos(f, a),
        centred_cosine=_cos(f - f.mean(), a - a.mean()),
        argmax_agrees=top == int(f.argmax()),
        p_answer=None if answer is None else float(logp_a[answer].exp()),
        answer_is_argmax=None if answer is None else top == answer,
        finite=finite,
    )
