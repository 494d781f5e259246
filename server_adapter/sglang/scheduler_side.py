"""The scheduler process's half: answer ``LeylineSpliceReqInput`` with the executor.

Runs on SGLang's scheduler thread between batches (control requests are dispatched from
its event loop), so no forward pass writes the pools meanwhile. Every TP rank receives the
request and applies the same splice to its own pools and tree, as it does for generates.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.errors import LeylineError
from leyline.protocol.fallback import FallbackReason
from leyline.server_adapter.errors import SpliceUnsupportedError

from .executor import SpliceExecutor
from .forget import forget_after
from .kv_rows import kv_rows_for
from .rope_source import band_of_model
from .tree_ops import TreeOps
from .wire import LeylineSpliceReqInput, LeylineSpliceReqOutput


def executor_for(scheduler: Any) -> SpliceExecutor:
    """Build (once) the executor over a scheduler's tree, pool and model RoPE, or refuse."""
    cached = getattr(scheduler, "_leyline_executor", None)
    if cached is not None:
        return cached  # type: ignore[no-any-return]
    try:
        tree = TreeOps(scheduler.tree_cache)
        model = scheduler.tp_worker.model_runner.model
        pool = scheduler.token_to_kv_pool_allocator.get_kvcache()
    except AttributeError as exc:
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_runtime, f"scheduler layout not recognised: {exc}"
        ) from exc
    executor = SpliceExecutor(
        tree, kv_rows_for(pool, band_of_model(model)), scheduler.req_to_token_pool
    )
    scheduler._leyline_executor = executor
    return executor


def handle(scheduler: Any, req: LeylineSpliceReqInput) -> LeylineSpliceReqOutput:
    """Execute one request; every failure becomes a typed answer, never an exception."""
    try:
        executor = executor_for(scheduler)
        mode = Mode.forget if req.verb == "forget" else Mode.amortize
        edits = [Edit(s, e, tuple(r), mode, i) for i, (s, e, r) in enumerate(req.edits)]
        if mode is Mode.forget:
            start = min(e.start for e in edits)
            out = forget_after(executor.tree, req.old_tokens, start)
            return LeylineSpliceReqOutput(ok=True, cached_tokens=out.kept_prefix, rid=req.rid)
        result = executor.splice(req.old_tokens, edits)
        return LeylineSpliceReqOutput(
            ok=True,
            rid=req.rid,
            tokens=list(result.tokens),
            cached_tokens=result.cached_tokens,
            reused_tokens=result.reused_tokens,
            rotated_tokens=result.rotated_tokens,
            pending_prefill=result.pending_prefill,
            fallback_reason=result.fallback_reason,
        )
    except SpliceUnsupportedError as exc:
        return LeylineSpliceReqOutput(
            ok=False, rid=req.rid, fallback_reason=exc.reason, message=exc.message
        )
    except LeylineError as exc:
        return LeylineSpliceReqOutput(
            ok=False,
            rid=req.rid,
            error_code=exc.code,
            error_field=exc.field,
            message=exc.message,
        )


def install(scheduler: Any) -> None:
    """Route ``LeylineSpliceReqInput`` to :func:`handle` in this scheduler's dispatcher."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(LeylineSpliceReqInput, partial(handle, scheduler))]
    )
