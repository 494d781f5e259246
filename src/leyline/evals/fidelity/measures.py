"""The three measures every figure of this eval is made of (fp64, no shortcuts)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> float:
    """KL(P || Q) in nats, P and Q given as next-token logits."""
    p = torch.log_softmax(p_logits.double(), -1)
    q = torch.log_softmax(q_logits.double(), -1)
    return float((p.exp() * (p - q)).sum())


def rel_l2(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want||, in fp64."""
    g, w = got.double(), want.double()
    return float((g - w).norm() / w.norm().clamp_min(1e-300))


def quantiles(values: Sequence[float]) -> dict[str, float]:
    """mean, median, p95 and max (nan for an empty list)."""
    if not values:
        return {k: math.nan for k in ("mean", "median", "p95", "max")}
    t = torch.tensor(list(values), dtype=torch.float64)
    return {
        "mean": float(t.mean()),
        "median": float(t.quantile(0.5)),
        "p95": float(t.quantile(0.95)),
        "max": float(t.max()),
    }


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log y on log x: the exponent b of y ~ a·x^b."""
    lx = torch.tensor([math.log(x) for x in xs], dtype=torch.float64)
    ly = torch.tensor([math.log(y) for y in ys], dtype=torch.float64)
    lx, ly = lx - lx.mean(), ly - ly.mean()
    return float((lx * ly).sum() / (lx * lx).sum())
