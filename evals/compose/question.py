"""The question-aware recompute arm, ``compose_k{K}_ask{P}``: recompute what the question needs.

Deviation recompute (the server's mode) ranks the block's tokens by how much the new
context changes their KV, whatever is asked next. This arm ranks them by how much the
question reads them: after the seam-only compose (last token run in context), the question
is run once on a copy of that KV with attention weights returned, and each copied block
token scores the attention mass all question queries give it, summed over layers and heads.
The ``ceil(P/100 * (L - K))`` top tokens are then recomputed through every layer at their
positions exactly as the deviation mode recomputes its selection
(``partial_forward.forward_scattered``), and the question is prefilled on the result.

It needs the question when the block is composed (true of a chat turn that carries both)
and one extra forward of the question; it is an eval arm, not a server mode. Attention
weights need the eager attention kernel, switched on for that one forward.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from transformers import DynamicCache

from leyline.server_adapter.engine import Engine
from leyline.server_adapter.forward import forward_into, kv_length, new_buffers
from leyline.server_adapter.kv_blocks import KVCache
from leyline.server_adapter.partial_forward import forward_scattered
from leyline.server_adapter.recompute import recompute_count, select_largest
from leyline.server_adapter.session import SessionCache
from leyline.server_adapter.skills import Skill


@torch.inference_mode()
def question_attention(
    engine: Engine, kv: KVCache, question: Sequence[int], lo: int, hi: int
) -> torch.Tensor:
    """Attention mass the question's queries give positions ``[lo, hi)`` of ``kv``, summed
    over layers, heads and queries (fp64 ``[hi - lo]``); ``kv`` is only read."""
    model = engine.model
    cache = DynamicCache()
    for i, (keys, values) in enumerate(kv):
        cache.update(keys.clone(), values.clone(), i)
    start = kv_length(kv)
    ids = torch.tensor([list(question)], device=model.device)
    pos = torch.arange(start, start + len(question), device=model.device).unsqueeze(0)
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")  # the only kernel that returns the weights
    try:
        out = model(
            input_ids=ids, position_ids=pos, cache=cache, use_cache=True, output_attentions=True
        )
    finally:
        model.set_attn_implementation(previous)
    total = torch.zeros(hi - lo, dtype=torch.float64)
    for weights in out.attentions:  # [1, heads, queries, keys] per layer
        total += weights[0, :, :, lo:hi].double().sum((0, 1)).cpu()
    return total


def ask_compose(
    prefix: SessionCache, skill: Skill, seam: int, question: Sequence[int], ratio: float
) -> tuple[torch.Tensor, float, str]:
    """Next-token logits after the question, the seconds from the cached prefix, the path."""
    engine = prefix.engine
    session = prefix.fork()
    t0 = time.perf_counter()
    at = len(prefix.tokens)
    report = session.compose(skill, at, seam_tokens=seam, want_logits=True)
    kv, tokens = session.kv, session.tokens
    lo, hi = at + min(seam, len(skill)), at + len(skill)
    total = kv_length(kv)
    buffers = new_buffers(kv, total + len(question))
    for layer, slots in zip(kv, buffers, strict=True):
        for src, dst in zip(layer, slots, strict=True):
            dst[..., :total, :].copy_(src)
    if hi > lo:
        score = question_attention(engine, kv, question, lo, hi)
        chosen = [lo + i for i in select_largest(score, recompute_count(ratio, hi - lo))]
        forward_scattered(
            engine.model, buffers, [tokens[p] for p in chosen], chosen, chunk=engine.prefill_chunk
        )
    logits = forward_into(
        engine.model, buffers, total, question, capacity=total + len(question),
        chunk=engine.prefill_chunk,
    )  # fmt: skip
    return logits, time.perf_counter() - t0, report.path.value
