"""The entry point, the wire structs, and the directive service over real cache classes.

The zmq hop and SGLang's HTTP server are not run (no CPU build of SGLang's server); the
service talks to ``scheduler_side.handle`` in-process instead, on a real tree and pool.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leyline.protocol import ErrorCode, FallbackReason, LeylineError, Limits, Path
from leyline.protocol.directives import ForgetDirective, SpliceDirective
from leyline.protocol.spans import TokenSpan
from leyline.server_adapter.sglang import plugin
from leyline.server_adapter.sglang.directive_service import DirectiveService
from leyline.server_adapter.sglang.scheduler_side import handle
from leyline.server_adapter.sglang.tree_ops import TreeOps
from leyline.server_adapter.sglang.wire import LeylineSpliceReqInput, LeylineSpliceReqOutput

from ._stack import Stack, build
from .test_splice_mla import _prefill_extension

OLD = list(range(100, 180))


def test_plugin_loads_through_the_entry_point() -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry

    (ep,) = [e for e in md.entry_points(group=GENERAL_PLUGINS_GROUP) if e.name == "leyline"]
    assert ep.value == "leyline.server_adapter.sglang.plugin:register"
    loaded = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    func, _dist = loaded["leyline"]
    assert func is plugin.register
    saved = {k: list(v) for k, v in HookRegistry._hooks.items()}
    try:
        func()
        assert plugin.SCHEDULER_TARGET in HookRegistry._hooks
        assert plugin.TOKENIZER_TARGET in HookRegistry._hooks
    finally:
        HookRegistry._hooks.clear()
        HookRegistry._hooks.update(saved)


def test_wire_structs_survive_sglang_ipc_encoding() -> None:
    from sglang.srt.managers.io_struct import msgpack_decode, msgpack_encode

    req = LeylineSpliceReqInput(verb="splice", old_tokens=[1, 2, 3], edits=[(0, 1, [9])])
    assert msgpack_decode(msgpack_encode(req)) == req
    out = LeylineSpliceReqOutput(ok=False, fallback_reason="missing_source", message="gone")
    assert msgpack_decode(msgpack_encode(out)) == out


class _LocalLink:
    """The scheduler in-process: real tree and pool, no zmq."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        model = torch.nn.Module()
        model.rotary_emb = stack.rope
        self.scheduler = SimpleNamespace(
            tree_cache=stack.tree,
            tp_worker=SimpleNamespace(model_runner=SimpleNamespace(model=model)),
            token_to_kv_pool_allocator=stack.allocator,
            req_to_token_pool=stack.req_to_token,
        )
        self.prefilled: list[int] = []

    async def send(self, req: LeylineSpliceReqInput) -> LeylineSpliceReqOutput:
        return handle(self.scheduler, req)

    async def prefill(self, tokens: Sequence[int]) -> None:
        self.prefilled.append(len(tokens))
        _prefill_extension(self.stack, list(tokens))


def _service(stack: Stack) -> tuple[DirectiveService, _LocalLink]:
    link = _LocalLink(stack)
    return DirectiveService(link, lambda t: [ord(c) for c in t], Limits()), link


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_splice_directive_end_to_end_on_real_classes() -> None:
    stack = build("unified-rust")
    service, link = _service(stack)
    session, _ = _run(service.create("s", OLD))
    splice = SpliceDirective(span=TokenSpan(start=20, end=50), replacement=[7, 8, 9])
    resp = _run(service.apply(session, [splice], 0, True))
    assert (resp.path, resp.revision, resp.fallback_reason) == (Path.splice, 1, None)
    assert link.prefilled == [80, 24]  # the session, then prefix + replacement + 1
    new = service.get(session).tokens
    assert new == tuple([*OLD[:20], 7, 8, 9, *OLD[50:]])
    assert resp.reused_tokens + resp.prefilled_tokens == len(new)
    assert TreeOps(stack.tree).match(list(new)).length == len(new)


def test_stale_revision_and_bad_span_are_typed_errors() -> None:
    stack = build("legacy")
    service, _ = _service(stack)
    session, _ = _run(service.create(None, OLD))
    with pytest.raises(LeylineError) as info:
        _run(service.apply(session, [SpliceDirective(span=TokenSpan(start=0, end=1))], 3, True))
    assert info.value.code is ErrorCode.revision_conflict
    with pytest.raises(LeylineError) as info:
        _run(service.apply(session, [SpliceDirective(span=TokenSpan(start=0, end=99))], 0, True))
    assert info.value.code is ErrorCode.invalid_span
    assert service.get(session).revision == 0


def test_evicted_source_falls_back_with_its_reason() -> None:
    stack = build("unified-python")
    service, _ = _service(stack)
    session, _ = _run(service.create("s", OLD))
    TreeOps(stack.tree).evict_all()
    resp = _run(
        service.apply(session, [SpliceDirective(span=TokenSpan(start=10, end=20))], 0, True)
    )
    assert (resp.path, resp.fallback_reason) == (Path.reprefill, FallbackReason.missing_source)
    assert resp.reused_tokens == 10


def test_forget_directive_purges_and_answers_reprefill() -> None:
    stack = build("legacy")
    service, _ = _service(stack)
    session, _ = _run(service.create("s", OLD))
    resp = _run(
        service.apply(session, [ForgetDirective(span=TokenSpan(start=30, end=40))], 0, True)
    )
    assert (resp.path, resp.fallback_reason, resp.reused_tokens) == (Path.reprefill, None, 30)
    assert TreeOps(stack.tree).match(OLD).length == 30
