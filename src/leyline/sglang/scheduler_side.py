"""The scheduler process's half: answer ``LeylineSpliceReqInput`` with the executor.

Runs on SGLang's scheduler thread between batches (control requests are dispatched from
its event loop), so no forward pass writes the pools meanwhile. Every TP rank receives the
request and applies the same splice to its own pools and tree, as it does for generates.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from leyline.core.errors import SpliceUnsupportedError
from leyline.protocol.algebra import Edit
from leyline.protocol.directives import Mode
from leyline.protocol.errors import ErrorCode, LeylineError
from leyline.protocol.fallback import FallbackReason
from leyline.sglang.executor import SpliceExecutor
from leyline.sglang.forget import forget_after
from leyline.sglang.kv_rows import kv_rows_for
from leyline.sglang.rope_source import band_of_model
from leyline.sglang.tree_ops import TreeOps
from leyline.sglang.wire import LeylineSpliceReqInput, LeylineSpliceReqOutput, blocks_of

#: Skills may lock at most 1/HELD_SHARE of the KV pool: the rest stays for requests.
HELD_SHARE = 4


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
        if req.verb in ("hold", "release"):
            held, released = _hold(scheduler, executor.tree, req)
            return LeylineSpliceReqOutput(
                ok=True, cached_tokens=held, released=released, rid=req.rid
            )
        # ``forget`` purges from its earliest FORGET (every edit, if none is marked); a
        # ``splice`` may carry FORGETs too (a mixed batch, built as rule 6 says).
        forgets = set(req.forgets)
        if req.verb == "forget" and not forgets:
            forgets = set(range(len(req.edits)))
        edits = [
            Edit(s, e, tuple(r), Mode.forget if i in forgets else Mode.amortize, i)
            for i, (s, e, r) in enumerate(req.edits)
        ]
        if req.verb == "forget":
            start = min(e.start for e in edits if e.mode is Mode.forget)
            out = forget_after(executor.tree, req.old_tokens, start, req.old_salt)
            return LeylineSpliceReqOutput(ok=True, cached_tokens=out.kept_prefix, rid=req.rid)
        result = executor.splice(
            req.old_tokens,
            edits,
            blocks=blocks_of(req),
            old_salt=req.old_salt,
            new_salt=req.new_salt,
        )
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


def _hold(scheduler: Any, tree: TreeOps, req: LeylineSpliceReqInput) -> tuple[int, list[str]]:
    """``hold``: lock what the tree holds of ``req.old_tokens`` (in ``req.old_salt``) under
    ``req.key``, replacing any earlier lock of that key, releasing keys of
    ``req.evictable`` (in order) only if that makes room; ``release``: let the key's lock
    go. A locked path is never evicted: a registered skill's KV stays until it is deleted.
    Refused (``limit_exceeded``) with nothing changed when no room can be made. Returns how
    many tokens are held, and the keys released."""
    holds: dict[str, tuple[Any, int]] = scheduler.__dict__.setdefault("_leyline_holds", {})
    released: list[str] = []
    if req.verb == "hold":
        others = {k: n for k, (_, n) in holds.items() if k != req.key}
        cap = int(tree.allocator.size) // HELD_SHARE
        over = sum(others.values()) + len(req.old_tokens) - cap
        for victim in req.evictable:
            if over <= 0:
                break
            if victim in others and victim not in released:
                released.append(victim)
                over -= others[victim]
        if over > 0:
            raise LeylineError(
                ErrorCode.limit_exceeded,
                f"skills may hold {cap} of this server's {tree.allocator.size} KV slots; "
                f"{sum(others.values())} are held (by skills in use, or past what releasing "
                f"idle ones frees) and this one needs {len(req.old_tokens)}",
                "tokens",
            )
    for victim in released:
        tree.unlock(holds.pop(victim)[0])
    previous = holds.pop(req.key, None)
    held = 0
    if req.verb == "hold":
        match = tree.match(req.old_tokens, req.old_salt)
        held = match.length
        if held:
            holds[req.key] = (tree.lock(match.node), held)
    if previous is not None:
        tree.unlock(previous[0])
    return held, released


def install(scheduler: Any) -> None:
    """Route ``LeylineSpliceReqInput`` to :func:`handle` in this scheduler's dispatcher."""
    from sglang.utils import TypeBasedDispatcher

    scheduler._request_dispatcher += TypeBasedDispatcher(
        [(LeylineSpliceReqInput, partial(handle, scheduler))]
    )
