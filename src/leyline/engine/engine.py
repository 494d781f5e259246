"""The reference engine: one model, its RoPE and cache layout, a shared prefix cache.

Sessions are ``session.SessionCache`` objects over an engine; the server keeps them in the
backend-neutral session core (``core.sessions``) through ``engine_backend``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import PreTrainedModel

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.attention import use_grouped_sdpa
from leyline.engine.batched_decode import Row, batches_decode, forward_rows
from leyline.engine.cpu.packed_linear import PackReport, pack_linear_layers
from leyline.engine.edits.edit_paths import Splicer
from leyline.engine.edits.in_place_edit import in_place_layout
from leyline.engine.edits.recompute import SELECTION_LAYER
from leyline.engine.forward import DEFAULT_PREFILL_CHUNK, Forwards, KVBuffers
from leyline.engine.kv.kv_blocks import KVCache
from leyline.engine.kv.layouts import CacheLayout, detect_layout
from leyline.engine.kv.prefix_cache import PrefixCache
from leyline.engine.lean_layers import fused_layers, use_lean_layers
from leyline.engine.models import LoadedModel, load_model
from leyline.engine.rope import RopeSpec, rope_spec
from leyline.protocol.capabilities import Limits
from leyline.protocol.errors import ErrorCode, LeylineError

IN_PLACE_SWITCH = "LEYLINE_IN_PLACE_EDITS"


class Engine:
    """Owns the model and everything shared between sessions.

    RoPE and layout are read once at start. If the model cannot be rotated exactly
    (dynamic NTK, sliding windows, an unknown layout) the engine still serves: every
    splice that would move a key falls back to re-prefill with ``splice_refusal.reason``.
    """

    def __init__(
        self,
        loaded: LoadedModel,
        *,
        prefix_cache: PrefixCache | None = None,
        limits: Limits | None = None,
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
    ) -> None:
        self.loaded = loaded
        # transformers' PreTrainedModel.eval() is unannotated (it returns the model itself).
        self.model: PreTrainedModel = loaded.model.eval()  # type: ignore[no-untyped-call]
        grouped = use_grouped_sdpa(self.model)  # grouped heads read in place: ``attention``
        self.packing: PackReport = pack_linear_layers(self.model)
        """Linear layers on oneDNN's packed weights (``packed_linear``), or why not."""
        self.lean_layers = use_lean_layers(self.model)
        """Decoder layers on the lean forward (``lean_layers``; 0: transformers' own)."""
        self.fused_layers = fused_layers(self.model)
        """Of those, layers whose few-row forwards run fused (``layer_kernel``)."""
        self.tokenizer = loaded.tokenizer
        self.prefix_cache = prefix_cache
        self.forwards = Forwards(self.model, prefill_chunk)
        """The model's forwards over KV buffers (``forward``), at :attr:`prefill_chunk`."""
        max_positions = int(getattr(self.model.config, "max_position_embeddings", 0)) or None
        self.limits = limits or Limits(max_session_tokens=max_positions)
        self.rope: RopeSpec | None = None
        self.layout: CacheLayout | None = None
        self.splice_refusal: SpliceUnsupportedError | None = None
        self.batches_decode = batches_decode(self.model)
        """Concurrent generations' decode steps run as one batch (``batched_decode``)."""
        self.recompute_selection_layer = SELECTION_LAYER
        """The decoder layer whose in-context KV ranks a deviation compose's tokens
        (``recompute``; capped at the model's last layer)."""
        try:
            self.rope = rope_spec(self.model)
            self.layout = detect_layout(self.model, self.rope)
        except SpliceUnsupportedError as exc:
            self.splice_refusal = exc
        self.can_edit_in_place = in_place_layout(self.layout, self.rope, grouped)
        """The model can take in-place edits (GQA keys on the engine's attention)."""
        self.edits_in_place = self.can_edit_in_place and os.environ.get(IN_PLACE_SWITCH) != "0"
        """A session that owns its KV edits it inside its own buffers (``in_place_edit``):
        no second KV during a splice (docs/perf.md). On by default;
        ``LEYLINE_IN_PLACE_EDITS=0`` (or False here) keeps every edit on the copy path."""

    @classmethod
    def load(
        cls,
        source: str | Path | None = None,
        *,
        prefix_cache_bytes: int = 0,
        block_size: int = 16,
        dtype: torch.dtype = torch.float32,
        **kwargs: object,
    ) -> Engine:
        """Load ``source`` (see ``load_model``) in ``dtype`` (weights and cache) with an
        optional shared prefix cache."""
        cache = None
        if prefix_cache_bytes:
            cache = PrefixCache(prefix_cache_bytes, block_size=block_size)
        loaded = load_model(source, dtype=dtype)
        return cls(loaded, prefix_cache=cache, **kwargs)  # type: ignore[arg-type]

    # -- model access ----------------------------------------------------------------

    @property
    def prefill_chunk(self) -> int:
        """Most tokens one forward runs at once; a longer pass runs in chunks of this many."""
        return self.forwards.chunk

    @prefill_chunk.setter
    def prefill_chunk(self, chunk: int) -> None:
        if chunk < 1:
            raise ValueError(f"prefill_chunk must be at least 1, got {chunk}")
        self.forwards = Forwards(self.model, chunk)  # every edit's forwards read this one

    @property
    def vocab_size(self) -> int:
        return int(self.model.config.vocab_size)

    def forward(
        self, kv: KVCache, tokens: Sequence[int], *, reserve: int = 0
    ) -> tuple[KVCache, torch.Tensor]:
        """New KV of ``kv`` + ``tokens`` (``kv`` itself is only read) and next-token logits;
        ``reserve``: positions of room left past them in the new buffers."""
        return self.forwards.tokens(kv, tokens, reserve=reserve)

    def forward_into(self, buffers: KVBuffers, length: int, tokens: Sequence[int]) -> torch.Tensor:
        """Prefill ``tokens`` in place after the first ``length`` buffered positions."""
        return self.forwards.into(buffers, length, tokens)

    def forward_rows(self, rows: Sequence[Row]) -> torch.Tensor:
        """One decode step of several generations (``batched_decode``): logits ``[B, V]``.
        A single row, or a model the batched step does not support, runs row by row."""
        if len(rows) > 1 and self.batches_decode:
            return forward_rows(self.model, rows)
        return torch.stack([self.forward_into(r.buffers, r.length, [r.token]) for r in rows])

    @property
    def splicer(self) -> Splicer:
        """What edits need of this engine, as it is configured now (``edit_paths``)."""
        in_place = self.edits_in_place and self.can_edit_in_place
        return Splicer(self.forwards, self.layout, self.rope, self.splice_refusal, in_place)

    def encode(self, text: str) -> tuple[int, ...]:
        """Text to token ids, no special tokens added (the one tokenizer path)."""
        if self.tokenizer is None:
            raise LeylineError(
                ErrorCode.invalid_directive,
                f"{self.loaded.label} has no tokenizer; send token ids instead of text",
            )
        return tuple(int(t) for t in self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        if self.tokenizer is None:
            return " ".join(str(t) for t in tokens)
        return str(self.tokenizer.decode(list(tokens), skip_special_tokens=False))
