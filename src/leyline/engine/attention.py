"""Scaled-dot-product attention that reads grouped key/value heads in place.

transformers' ``sdpa`` attention copies a grouped-query model's key/value heads once per
query head (``repeat_kv``) whenever a mask comes with more than one query: every prefill
chunk after the first, every splice's replacement, every masked pass (``forward.forward_at``).
torch's SDPA takes the grouped heads as they are (``enable_gqa``), mask or not, bitwise
equal on CPU and several times faster (docs/engine.md, "Grouped heads read in place").
Registered under :data:`NAME` for models loaded with ``sdpa``; it also runs the per-row
attention of a batched decode step (``batched_decode``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from leyline.engine.attention_mass import ATTENTION_MASS_KWARG, AttentionMass
from leyline.engine.batched_decode import ROWS_KWARG, RowsView, rows_attention
from leyline.engine.cpu import attention_kernel
from leyline.engine.decode_attention import single_query_attention, takes_single_query
from leyline.engine.forward import QUERY_RUNS_KWARG
from leyline.engine.segment_attention import SEGMENTS_KWARG, SegmentPlan, segmented_attention

NAME = "leyline_sdpa"


def grouped_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, None]:
    """The ``sdpa`` attention function's contract, without expanding grouped heads."""
    if kwargs.get("softcap") is not None or kwargs.get("position_bias") is not None:
        raise ValueError(f"{NAME} supports neither softcap nor a position bias")
    mass = kwargs.get(ATTENTION_MASS_KWARG)
    if isinstance(mass, AttentionMass):  # a forward that must see the weights (COMPOSE)
        return mass.attend(query, key, value, attention_mask, scaling), None
    plan = kwargs.get(SEGMENTS_KWARG)
    if isinstance(plan, SegmentPlan):  # an in-place edit's forward: KV read where it lies
        layer = getattr(module, "layer_idx", None)
        if not isinstance(layer, int):
            raise ValueError(f"{NAME}: an in-place forward needs the layer's index")
        out = segmented_attention(layer, query, key, value, attention_mask, scaling, plan)
        return out, None
    rows = kwargs.get(ROWS_KWARG)
    if isinstance(rows, RowsView):  # a batched decode step: each row over its own buffer
        return rows_attention(module, query, rows, scaling), None
    runs = kwargs.get(QUERY_RUNS_KWARG)
    if isinstance(runs, tuple) and attention_mask is not None and len(runs) > 1:
        return _by_runs(query, key, value, attention_mask, scaling, runs), None
    if attention_mask is None and takes_single_query(query, key, value):  # a decode step
        return single_query_attention(query, key, value, scaling).transpose(1, 2), None
    q_len, kv_len = query.shape[2], key.shape[2]
    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    causal = causal and q_len > 1 and attention_mask is None
    if causal and kv_len > q_len:
        # No mask and more keys than queries: transformers only skips the mask when the
        # keys past the queries are empty slots (a fresh static cache); drop them.
        key, value = key[:, :, :q_len], value[:, :, :q_len]
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        scale=scaling,
        is_causal=causal,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return out.transpose(1, 2).contiguous(), None


def _by_runs(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    runs: tuple[tuple[int, int, int], ...],
) -> torch.Tensor:
    """Masked attention of scattered queries (``forward.forward_at``), run by run: each run
    reads only the keys it can see, and a single query (a splice's last token) needs no
    mask at all. The same scores as one masked call over every key (the mask hides
    exactly what is cut), about half the time at 4k on this CPU: torch's kernel is slow
    with an explicit mask over long keys. A run of several queries (a replacement) goes to
    the compiled kernel's causal runs where it takes them (``AttentionKernel.takes_run``)."""
    gqa = query.shape[1] != key.shape[1]
    kernel = attention_kernel.load()
    outs = []
    for first, end, seen in runs:
        q = query[:, :, first:end]
        k, v = key[:, :, :seen], value[:, :, :seen]
        if takes_single_query(q, k, v):  # a splice's last token: no mask, a decode step's read
            outs.append(single_query_attention(q, k, v, scaling))
            continue
        count = end - first
        if (
            seen >= attention_kernel.RUN_MIN_KEYS
            and kernel is not None
            and kernel.takes_run(q, k, v)
        ):
            causal = [seen - count + 1 + j for j in range(count)]  # a replacement: causal
            run_out = kernel.attend_runs([(q, k, v, causal)], scaling, checked=True)
            outs.append(run_out.to(query.dtype))
            continue
        m = None if end - first == 1 else mask[..., first:end, :seen]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=scaling, enable_gqa=gqa)
        outs.append(out)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def use_grouped_sdpa(model: PreTrainedModel) -> bool:
    """Switch a model that runs transformers' ``sdpa`` to :func:`grouped_sdpa_forward`
    (same masks); returns whether it did."""
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    if NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(NAME, grouped_sdpa_forward)
        ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    model.config._attn_implementation = NAME
    for sub in model.modules():  # sub-configs (a text model inside a wrapper) follow
        config = getattr(sub, "config", None)
        if config is not None and getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation = NAME
    return True
