"""Attention over a cache read where it lies: key segments merged by their log-sum-exp.

An edit run in place (``in_place_edit``) computes its new tokens before it moves anything:
their keys and values go to a small side buffer, and the kept KV stays at its old positions
in the session's own buffer until the forward is done. A query then sees three kinds of
segment, each attended on its own and merged exactly (softmax over a union of key sets is
the log-sum-exp-weighted mix of the parts' softmaxes):

- **kept KV that has not moved** (the prefix before the first change), read in place;
- **kept KV that will move by ``delta``**, read at its old positions with the query's rotary
  band rotated by ``-delta``: RoPE scores depend on relative position only, so
  ``q(p - delta) . k(o)`` is the score of ``q(p)`` against the key moved to ``o + delta``;
- **the side buffer** (the tokens this forward computes), causally: a query sees the side
  entries up to its own.

A lone query (the last token run again) takes every segment in one call of the
single-query kernel (``AttentionKernel.attend_segments``), which merges them as it merges
its own key chunks; a run of several (the replacement) takes them in one call of its
causal runs (``AttentionKernel.attend_runs``) where the kernel takes it; otherwise the
segments are attended one by one and merged here.

The model's attention function (``attention.grouped_sdpa_forward``) takes this path when the
forward passes a :class:`SegmentPlan` under :data:`SEGMENTS_KWARG`; the cache layer hands it
the side buffer as ``key``/``value`` and the attention mask of the side entries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from . import attention_kernel
from .kv_blocks import KVCache

SEGMENTS_KWARG = "leyline_segments"
"""The model-forward keyword carrying a :class:`SegmentPlan` to the attention function."""

RotateQuery = Callable[[torch.Tensor, int], torch.Tensor]
"""A query ``[1, heads, m, d]`` with its rotary band rotated by ``delta`` (a new tensor)."""


@dataclass(frozen=True, slots=True)
class KeptSegment:
    """Old-buffer positions ``[start, end)`` a query run sees whole; their keys belong
    ``delta`` positions further on in the new sequence."""

    start: int
    end: int
    delta: int


@dataclass(frozen=True, slots=True)
class SegmentRun:
    """Queries ``[first, end)`` of the forward's chunk: consecutive positions that see the
    ``kept`` segments whole and the side entries ``[0, side_seen)`` causally (the run's
    queries are the side entries ``[side_seen - (end - first), side_seen)``)."""

    first: int
    end: int
    kept: tuple[KeptSegment, ...]
    side_seen: int


@dataclass(frozen=True, slots=True)
class SegmentPlan:
    """What every layer's attention reads for one chunk of an in-place forward."""

    old: KVCache
    """The session's buffers, per layer ``(keys, values)``, at their old positions."""
    runs: tuple[SegmentRun, ...]
    rotate: RotateQuery


Part = tuple[torch.Tensor, torch.Tensor]
"""One segment's attention output ``[1, heads, m, dv]`` and log-sum-exp ``[1, heads, m]``,
both fp32."""


def segmented_attention(
    layer: int,
    query: torch.Tensor,
    side_key: torch.Tensor,
    side_value: torch.Tensor,
    side_mask: torch.Tensor | None,
    scale: float | None,
    plan: SegmentPlan,
) -> torch.Tensor:
    """Attention of ``query [1, heads, m, d]`` under ``plan`` at decoder layer ``layer``;
    returns ``[1, m, heads, dv]`` in the query's dtype (the attention function's layout).
    ``side_mask``: additive ``[1, 1, m, side]``, the side entries each query sees."""
    keys, values = plan.old[layer]
    kernel = attention_kernel.load()
    outs: list[torch.Tensor] = []
    for run in plan.runs:
        q = query[:, :, run.first : run.end]
        rotated: dict[int, torch.Tensor] = {0: q}
        segments = []
        for seg in run.kept:
            qd = rotated.get(seg.delta)
            if qd is None:
                qd = rotated[seg.delta] = plan.rotate(q, -seg.delta)
            k, v = keys[:, :, seg.start : seg.end], values[:, :, seg.start : seg.end]
            segments.append((qd, k, v))
        n = run.side_seen
        segments.append((q, side_key[:, :, :n], side_value[:, :, :n]))
        if (
            kernel is not None
            and run.end - run.first == 1
            and all(attention_kernel.eligible(*seg) for seg in segments)
        ):  # a lone query (the last token): every segment in one kernel call
            out, _ = kernel.attend_segments(segments, scale, checked=True)
            outs.append(out.to(query.dtype))
            continue
        run_keys = sum(seg[1].shape[2] for seg in segments)
        if (
            run_keys >= attention_kernel.RUN_MIN_KEYS
            and kernel is not None
            and all(kernel.takes_run(*seg, run_keys, len(segments)) for seg in segments)
        ):
            m = run.end - run.first  # kept segments whole, the side entries causally
            seen = [[seg[1].shape[2]] * m for seg in segments[:-1]]
            seen.append([n - m + 1 + j for j in range(m)])
            with_seen = [(*seg, c) for seg, c in zip(segments, seen, strict=True)]
            outs.append(kernel.attend_runs(with_seen, scale, checked=True).to(query.dtype))
            continue
        mask = None
        if run.end - run.first > 1 and side_mask is not None:
            mask = side_mask[..., run.first : run.end, :n]
        parts = [attend_part(*seg, None, scale) for seg in segments[:-1]]
        parts.append(attend_part(*segments[-1], mask, scale))
        outs.append(merge_parts(parts).to(query.dtype))
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def attend_part(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float | None,
) -> Part:
    """Attention of ``query`` over one segment, with its log-sum-exp (see :data:`Part`), on
    torch's CPU flash kernel, which takes grouped heads as they are (a lone query's
    segments go to the single-query kernel together instead, :func:`segmented_attention`)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, 0.0, False, attn_mask=mask, scale=scale
    )
    return out.float(), lse.float()


def merge_parts(parts: Sequence[Part]) -> torch.Tensor:
    """The attention over the union of the parts' keys, fp32 ``[1, heads, m, dv]``."""
    if len(parts) == 1:
        return parts[0][0]
    lse = torch.stack([p[1] for p in parts])
    weights = torch.softmax(lse, dim=0).unsqueeze(-1)  # exp(lse_i - logsumexp(lse))
    out = parts[0][0] * weights[0]
    for i in range(1, len(parts)):
        out.add_(parts[i][0] * weights[i])
    return out
