"""One decode step for many generations at once: the weights stream once for all of them.

A small model's decode step on a CPU is bound by reading the weights, so B generations run
as one batch of B rows through the linear layers while each row keeps its own KV buffers
and length (:data:`Mode` says how attention reads them). Both modes equal stepping each
row alone up to fp32 rounding of the batched products (tests/engine/test_batched_decode.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel
from transformers.cache_utils import DynamicLayer

from leyline.engine.cpu.fused_forward import decode_rows
from leyline.engine.decode_attention import single_query_attention, takes_single_query
from leyline.engine.forward import KVBuffers

ROWS_KWARG = "leyline_rows"
"""The model-forward keyword that carries the rows to :func:`rows_attention`."""

Mode = Literal["rows", "padded"]
"""``rows`` (models whose attention reads the cache as stored, grouped-query keys and
values): each row's new entry is written at its own length and attention runs row by row
over its own buffer, grouped heads in place; no cache is gathered into a padded tensor.
``padded`` (MLA: the cache holds compressed latents the model expands after reading them):
the rows' latents, a few hundred bytes a token, are gathered into one padded batch with a
mask hiding each row's padding."""


@dataclass(frozen=True, slots=True)
class Row:
    """One generation's step: run ``token`` at position ``length`` of ``buffers``."""

    buffers: KVBuffers
    length: int
    token: int


class RowsView:
    """Each row's keys and values up to and including its new entry, per layer."""

    def __init__(self, rows: Sequence[Row]) -> None:
        self.rows = rows

    def layer(self, index: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [
            (
                r.buffers[index][0][..., : r.length + 1, :],
                r.buffers[index][1][..., : r.length + 1, :],
            )
            for r in self.rows
        ]


class RowsLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # unannotated __init_subclass__
    """A cache layer over B rows' own buffers: ``update`` writes row b's new entry at its
    length; it returns the new entries (``rows`` mode: attention reads the buffers) or the
    rows padded into one batch (``padded`` mode)."""

    def __init__(self, rows: Sequence[Row], index: int, mode: Mode) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # transformers' is unannotated
        self.rows, self.index, self.mode = rows, index, mode
        self.is_initialized, self.device = True, rows[0].buffers[index][0].device
        self.width = max(r.length for r in rows) + 1

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        for b, row in enumerate(self.rows):
            for slot, new in zip(row.buffers[self.index], (key_states, value_states), strict=True):
                slot[..., row.length : row.length + 1, :].copy_(new[b : b + 1])
        if self.mode == "rows":
            self.keys, self.values = key_states, value_states
            return key_states, value_states
        padded = []
        for s, new in enumerate((key_states, value_states)):
            out = new.new_zeros((*new.shape[:-2], self.width, new.shape[-1]))
            for b, row in enumerate(self.rows):
                out[b : b + 1, ..., : row.length + 1, :].copy_(
                    row.buffers[self.index][s][..., : row.length + 1, :]
                )
            padded.append(out)
        self.keys, self.values = padded
        return padded[0], padded[1]

    def get_seq_length(self) -> int:
        return self.width


def decode_mode(model: PreTrainedModel) -> Mode:
    """``padded`` for MLA (latents expanded after the cache read), else ``rows``."""
    return "padded" if getattr(model.config, "kv_lora_rank", None) is not None else "rows"


def batches_decode(model: PreTrainedModel) -> bool:
    """Whether :func:`forward_rows` runs on ``model``: MLA pads (any attention honours the
    mask); other models need the engine's attention function, which reads the rows."""
    if decode_mode(model) == "padded":
        return True
    # attention.NAME, spelled out: attention imports this module.
    return getattr(model.config, "_attn_implementation", None) == "leyline_sdpa"


def padding_mask(rows: Sequence[Row], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive ``[B, 1, 1, width]``: row b sees its first ``length + 1`` positions."""
    width = max(r.length for r in rows) + 1
    keys = torch.arange(width, device=device)
    lengths = torch.tensor([r.length for r in rows], device=device)
    hidden = keys.unsqueeze(0) > lengths.unsqueeze(1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
    mask.masked_fill_(hidden, torch.finfo(dtype).min)
    return mask[:, None, None, :]


@torch.no_grad()
def forward_rows(model: PreTrainedModel, rows: Sequence[Row]) -> torch.Tensor:
    """One token for each row at its own position, in one batch; their KV written into
    each row's buffers. Returns fp32 next-token logits ``[len(rows), vocab]``."""
    if not rows:
        raise ValueError("forward_rows needs at least one row")
    device = model.device
    mode = decode_mode(model)
    if mode == "rows" and not batches_decode(model):
        raise ValueError("per-row attention needs the engine's grouped SDPA (``attention``)")
    if mode == "rows":  # the fused loop where it applies
        stepped = decode_rows(model, [(r.buffers, r.length, r.token) for r in rows])
        if stepped is not None:
            return stepped
    dtype = rows[0].buffers[0][0].dtype
    cache = DynamicCache()
    cache.layers.extend(RowsLayer(rows, i, mode) for i in range(len(rows[0].buffers)))
    ids = torch.tensor([[r.token] for r in rows], dtype=torch.long, device=device)
    pos = torch.tensor([[r.length] for r in rows], dtype=torch.long, device=device)
    extra: dict[str, object] = {}
    if mode == "rows":
        mask = torch.zeros((len(rows), 1, 1, 1), dtype=dtype, device=device)  # unused
        extra[ROWS_KWARG] = RowsView(rows)
    else:
        mask = padding_mask(rows, dtype, device)
    out = model(
        input_ids=ids,
        position_ids=pos,
        attention_mask=mask,
        cache=cache,
        use_cache=True,
        logits_to_keep=1,
        **extra,
    )
    logits: torch.Tensor = out.logits[:, -1]
    return logits.float()


def rows_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    view: RowsView,
    scaling: float | None,
) -> torch.Tensor:
    """Row b's single query against row b's own keys and values (``[B, 1, heads, dim]``)."""
    index = int(getattr(module, "layer_idx", -1))
    outs = []
    for b, (keys, values) in enumerate(view.layer(index)):
        q = query[b : b + 1]
        if takes_single_query(q, keys, values):  # as a single generation's step computes it
            outs.append(single_query_attention(q, keys, values, scaling))
            continue
        outs.append(
            F.scaled_dot_product_attention(
                q, keys, values, scale=scaling, enable_gqa=q.shape[1] != keys.shape[1]
            )
        )
    return torch.cat(outs).transpose(1, 2).contiguous()
