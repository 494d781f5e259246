"""Attention over a cache read where it lies: key segments merged by their log-sum-exp.

An in-place edit (``in_place_edit``) runs its forward before it moves any kept KV, so a
query attends to each segment on its own (the unmoved prefix, each run that will move, the
side buffer of new tokens) and the parts are merged exactly: softmax over a union of key
sets is the log-sum-exp-weighted mix of the parts' softmaxes. docs/engine.md ("In place")
walks through it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from leyline.engine.cpu import attention_kernel
from leyline.engine.kv.kv_blocks import KVCache

SEGMENTS_KWARG = "leyline_segments"
"""The model-forward keyword carrying a :class:`SegmentPlan` to the attention function
(``attention.grouped_sdpa_forward``), which then takes this path; the cache layer hands it
the side buffer as ``key``/``value`` and the attention mask of the side entries."""

RotateQuery = Callable[[torch.Tensor, int], torch.Tensor]
"""A query ``[1, heads, m, d]`` with its rotary band rotated by ``delta`` (a new tensor)."""


@dataclass(frozen=True, slots=True)
class KeptSegment:
    """Old-buffer positions ``[start, end)`` a query run sees whole; their keys belong
    ``delta`` positions further on in the new sequence. They are read where they lie with
    the query's rotary band rotated by ``-delta``: RoPE scores depend on relative position
    only, so ``q(p - delta) . k(o)`` is the score of ``q(p)`` against the key moved to
    ``o + delta``. (``delta == 0``: the prefix before the first change, read as it is.)"""

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
    one = SegmentPlan((plan.old[layer],), plan.runs, plan.rotate)
    prepared = prepare_plan(one, [(side_key, side_value)], side_mask, query.shape[1], scale)
    return prepared.attend(0, query).view(1, query.shape[2], query.shape[1], -1)


def kernel_route(
    kernel: attention_kernel.AttentionKernel | None,
    segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> Literal["lone", "runs"] | None:
    """Where a run's segments ``(query, key, value)`` (the side entries last) go: a lone
    query's to the single-query kernel, all in one call, which merges them as it merges its
    own key chunks (``"lone"``); a run's to the kernel's causal query runs where it takes
    them and measured faster (``"runs"``); else None (torch's flash kernel, segment by
    segment, merged by :func:`merge_parts`)."""
    if kernel is None:
        return None
    if segments[0][0].shape[2] == 1 and all(attention_kernel.eligible(*s) for s in segments):
        return "lone"
    keys = sum(s[1].shape[2] for s in segments)
    if keys >= attention_kernel.RUN_MIN_KEYS and all(
        kernel.takes_run(*s, keys, len(segments)) for s in segments
    ):
        return "runs"
    return None


def run_seen(run: SegmentRun, lengths: Sequence[int]) -> list[list[int]]:
    """Per segment of ``run`` (its kept segments' ``lengths``, then the side entries), how
    many keys each query sees: kept segments whole, the side entries causally."""
    m = run.end - run.first
    seen = [[n] * m for n in lengths[:-1]]
    seen.append([run.side_seen - m + 1 + j for j in range(m)])
    return seen


class PreparedPlan:
    """A plan's attention at every layer of one forward, each run's work prepared once
    rather than at each layer (``fused_forward``'s splice pass; :func:`segmented_attention`
    is one layer's plan): a run that goes to the attention kernel has its call checked and
    tabled for all layers (:meth:`AttentionKernel.prepare`); one that goes to torch's flash
    kernel (a run too short for the kernel, or measured slower there: :func:`kernel_route`)
    has its segments' views and mask cut once."""

    __slots__ = ("_plan", "_runs", "_scale")

    def __init__(
        self,
        plan: SegmentPlan,
        runs: Sequence[tuple[SegmentRun, tuple[int, ...], _RunWork]],
        scale: float | None,
    ) -> None:
        self._plan, self._runs, self._scale = plan, tuple(runs), scale

    def attend(self, layer: int, query: torch.Tensor) -> torch.Tensor:
        """The attention of ``query [1, heads, m, d]`` at ``layer``, as ``[1, m, heads *
        dv]`` contiguous in the query's dtype."""
        outs = []
        for run, deltas, work in self._runs:
            q = query[:, :, run.first : run.end]
            rotated = {0: q}
            for delta in deltas:
                if delta not in rotated:
                    rotated[delta] = self._plan.rotate(q, -delta)
            queries = [rotated[delta] for delta in deltas]  # one per segment, the side's last
            if isinstance(work, attention_kernel.PreparedCall):
                stacked = torch.stack([x[0] for x in queries]).to(torch.float32)
                outs.append(work(layer, stacked))
                continue
            segments, mask = work[layer]
            parts = [attend_part(x, k, v, None, self._scale)
                     for x, (k, v) in zip(queries[:-1], segments[:-1], strict=True)]  # fmt: skip
            parts.append(attend_part(queries[-1], *segments[-1], mask, self._scale))
            outs.append(merge_parts(parts)[0])
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        return out.to(query.dtype).transpose(0, 1).reshape(1, query.shape[2], -1).contiguous()


_Segments = list[tuple[torch.Tensor, torch.Tensor]]
_RunWork = attention_kernel.PreparedCall | list[tuple[_Segments, torch.Tensor | None]]
"""A run's kernel call, or per layer its segments' views and the side entries' mask."""


def prepare_plan(
    plan: SegmentPlan,
    side: Sequence[Sequence[torch.Tensor]],
    side_mask: torch.Tensor | None,
    heads: int,
    scale: float | None,
) -> PreparedPlan:
    """``plan``'s attention prepared for every layer: its side entries in ``side`` (per
    layer, ``(keys, values)`` buffers ``[1, kv_heads, capacity, d]``), ``side_mask`` as
    :func:`segmented_attention` takes it (additive ``[1, 1, m, side]`` over the forward's
    ``m`` rows, or None), each run routed by :func:`kernel_route`."""
    kernel = attention_kernel.load()
    runs: list[tuple[SegmentRun, tuple[int, ...], _RunWork]] = []
    for run in plan.runs:
        m, n = run.end - run.first, run.side_seen
        layers = [
            [(keys[:, :, s.start : s.end], values[:, :, s.start : s.end]) for s in run.kept]
            + [(layer_side[0][:, :, :n], layer_side[1][:, :, :n])]
            for (keys, values), layer_side in zip(plan.old, side, strict=True)
        ]
        query = torch.empty(1, heads, m, layers[0][0][0].shape[3], dtype=layers[0][0][0].dtype)
        route = kernel_route(kernel, [(query, k, v) for k, v in layers[0]])
        deltas = (*(s.delta for s in run.kept), 0)
        if kernel is not None and route is not None:
            seen = None if route == "lone" else run_seen(run, [k.shape[2] for k, _ in layers[0]])
            runs.append((run, deltas, kernel.prepare(layers, heads, m, scale, seen)))
            continue
        mask = None if m == 1 or side_mask is None else side_mask[..., run.first : run.end, :n]
        runs.append((run, deltas, [(segments, mask) for segments in layers]))
    return PreparedPlan(plan, runs, scale)


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
