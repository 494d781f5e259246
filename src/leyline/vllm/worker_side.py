"""The connector's worker half: moves planned rows between blocks of every attention layer's
KV tensor, synchronously, before the forward that reads them.

At start each layer's layout is calibrated with that layer's own cache write
(``kv_layout.calibrate``) and the rope band is read; if either fails, every load is refused:
its destination blocks are reported as load errors (vLLM then recomputes or fails the
request, per its ``kv_load_failure_policy``) and the refusal goes back to the scheduler side.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.rope_band import RopeBand
from leyline.protocol.fallback import FallbackReason
from leyline.vllm.kv_layout import CacheWrite, KVLayout, RowShape, calibrate, shift_keys
from leyline.vllm.link import RowMoves


class WorkerSide:
    """Row moves over one worker's KV tensors."""

    def __init__(self) -> None:
        self._layers: list[tuple[torch.Tensor, KVLayout]] = []
        self._band: RopeBand | None = None
        self.refusal: SpliceUnsupportedError | None = SpliceUnsupportedError(
            FallbackReason.unsupported_layout, "no KV caches registered"
        )
        self._errors: set[int] = set()
        self._ran: list[SpliceUnsupportedError | None] = []

    def register(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        write_of: Callable[[str], CacheWrite],
        rows: RowShape,
        band: Callable[[], RopeBand],
    ) -> None:
        """Calibrate every distinct tensor of ``kv_caches`` with its layer's write
        (``write_of(name)``) and read the band; any failure refuses every later load."""
        self._layers, self._band = [], None
        try:
            seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
            for name, cache in kv_caches.items():
                key = (cache.data_ptr(), tuple(cache.shape), tuple(cache.stride()))
                if key in seen:  # a layer sharing another's KV: move its rows once
                    continue
                seen.add(key)
                self._layers.append((cache, calibrate(write_of(name), cache, rows)))
            self._band = band()
            self.refusal = None
        except SpliceUnsupportedError as refused:
            self._layers, self.refusal = [], refused

    def load(self, moves: RowMoves) -> None:
        """Write ``moves`` into every layer: gather from the sources, rotate K's band by
        each row's shift, scatter into the destinations."""
        if not moves:
            return
        self._ran.append(self.refusal)
        if self.refusal is not None or self._band is None:
            self._errors.update(moves.dst_blocks)
            return
        device = self._layers[0][0].device if self._layers else torch.device("cpu")
        src_blocks, src_offsets, dst_blocks, dst_offsets, shifts = (
            torch.tensor(column, dtype=torch.int64, device=device)
            for column in (
                moves.src_blocks,
                moves.src_offsets,
                moves.dst_blocks,
                moves.dst_offsets,
                moves.shifts,
            )
        )
        for cache, layout in self._layers:
            keys, values = layout.gather(cache, src_blocks, src_offsets)
            keys = shift_keys(keys, shifts, self._band)
            layout.scatter(cache, dst_blocks, dst_offsets, keys, values)

    def take_load_errors(self) -> set[int]:
        """Destination blocks of refused loads since the last call."""
        errors, self._errors = self._errors, set()
        return errors

    def take_steps_run(self) -> list[SpliceUnsupportedError | None]:
        """Per load run since the last call, the refusal it met (None: written)."""
        ran, self._ran = self._ran, []
        return ran
