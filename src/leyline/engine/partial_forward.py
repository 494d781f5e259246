"""A forward that stops after one decoder layer, for COMPOSE's deviation recompute.

:func:`forward_through` prefills tokens in place, as ``forward.forward_into`` does, through
the first layers only: the buffers of the later layers are left untouched. It takes the
model's decoder layers from ``get_decoder().layers`` (:func:`decoder_layers`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from contextlib import suppress

import torch
from transformers import PreTrainedModel

from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, KVBuffers, appending, run_chunks


class _Stop(Exception):
    """Raised before the first layer :func:`forward_through` must not run."""


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList | None:
    """The model's decoder layers in order, or None when they cannot be found."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    layers = getattr(decoder, "layers", None)
    expected = getattr(model.config, "num_hidden_layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != expected:
        return None
    return layers


def forward_through(
    model: PreTrainedModel,
    buffers: KVBuffers,
    length: int,
    tokens: Sequence[int],
    last_layer: int,
    *,
    chunk: int = DEFAULT_PREFILL_CHUNK,
) -> None:
    """Prefill ``tokens`` at positions ``length, length+1, ...`` through decoder layers
    ``0..last_layer`` only, attending to the first ``length`` buffered positions; their KV
    is written into those layers' buffers. Later layers are not run.

    The stop is a pre-hook on layer ``last_layer + 1`` that raises; it fires only on the
    calling thread (the model may be shared) and is removed before returning.
    """
    if not tokens:
        raise ValueError("forward_through needs at least one token")
    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found for a partial forward")
    if not 0 <= last_layer < len(layers) or len(buffers) != len(layers):
        raise ValueError(f"layer {last_layer} of {len(layers)}; {len(buffers)} buffered layers")
    caller = threading.get_ident()

    def stop(*_: object) -> None:
        if threading.get_ident() == caller:
            raise _Stop

    hook = (
        layers[last_layer + 1].register_forward_pre_hook(stop)
        if last_layer + 1 < len(layers)
        else None
    )
    try:
        _, prepare = appending(buffers, length, int(buffers[0][0].shape[-2]))
        for lo in range(0, len(tokens), chunk):  # one chunk per call: the stop ends each
            part = tokens[lo : lo + chunk]
            with suppress(_Stop):  # then layers 0..last_layer hold the chunk; the rest never ran
                positions = range(length + lo, length + lo + len(part))
                run_chunks(model, part, positions, prepare, chunk=chunk)
    finally:
        if hook is not None:
            hook.remove()
