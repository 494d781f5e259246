"""The entry point, the wire structs, and the session core over real cache classes.

The zmq hop and SGLang's HTTP server are not run here (``make sglang-live-check`` runs
them); the core's service and ``SglangBackend`` talk to ``scheduler_side.handle``
in-process instead, on a real tree and pool.
"""

from __future__ import annotations

import asyncio
import importlib.metadata as md
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from leyline.core.service import SessionService
from leyline.core.sessions import DEFAULT_TENANT, SessionStore
from leyline.protocol import ErrorCode, FallbackReason, LeylineError, Limits, Path
from leyline.protocol.directives import ComposeDirective, ForgetDirective, SpliceDirective
from leyline.protocol.resources import ApplyDirectives, SessionCreate, SkillCreate
from leyline.protocol.spans import TokenSpan
from leyline.sglang import plugin
from leyline.sglang.backend import SglangBackend
from leyline.sglang.link import SchedulerAnswer
from leyline.sglang.scheduler_side import handle
from leyline.sglang.tokenizer_side import TokenizerManagerLink
from leyline.sglang.tree_ops import TreeOps
from leyline.sglang.wire import LeylineSpliceReqInput, LeylineSpliceReqOutput, from_wire

from ._stack import Stack, build
from .test_splice_mla import _prefill_extension

OLD = list(range(100, 180))


def test_plugin_loads_through_the_entry_point() -> None:
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group
    from sglang.srt.plugins.hook_registry import HookRegistry

    (ep,) = [e for e in md.entry_points(group=GENERAL_PLUGINS_GROUP) if e.name == "leyline"]
    assert ep.value == "leyline.sglang.plugin:register"
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


class _LocalLink(TokenizerManagerLink):
    """The scheduler in-process: real tree and pool, no zmq. The server process's link
    (``send``, ``hold``, ``release``) with its IPC hop replaced by a direct call."""

    def __init__(self, stack: Stack) -> None:
        super().__init__(tokenizer_manager=None)
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
        self.salts: list[str | None] = []

    async def _ask(self, req: LeylineSpliceReqInput) -> SchedulerAnswer:
        return from_wire(handle(self.scheduler, req))

    async def prefill(self, tokens: Sequence[int], salt: str | None = None) -> None:
        self.prefilled.append(len(tokens))
        self.salts.append(salt)
        _prefill_extension(self.stack, list(tokens), salt)


class _Chars:
    """A character-level tokenizer: enough for text replacements in these tests."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, tokens: Sequence[int], skip_special_tokens: bool = False) -> str:
        return "".join(chr(t) for t in tokens)


def _service(stack: Stack) -> tuple[SessionService[Any], _LocalLink]:
    link = _LocalLink(stack)
    backend = SglangBackend(link, _Chars(), limits=Limits(), vocab_size=1 << 16)
    return SessionService(backend, SessionStore(backend)), link


def _run(coro: Any) -> Any:
    return asyncio.run(coro)


def _create(service: SessionService[Any], session: str | None, tokens: list[int]) -> str:
    info = _run(service.create(DEFAULT_TENANT, SessionCreate(session=session, tokens=tokens)))
    return str(info.session)


def _apply(service: SessionService[Any], session: str, directives: list[Any], base: int) -> Any:
    body = ApplyDirectives(base_revision=base, directives=directives)
    return _run(service.apply(DEFAULT_TENANT, session, body))


def _tokens(service: SessionService[Any], session: str) -> tuple[int, ...]:
    info = _run(service.get(DEFAULT_TENANT, session, include_tokens=True))
    return tuple(info.tokens)


def test_splice_directive_end_to_end_on_real_classes() -> None:
    stack = build("unified-rust")
    service, link = _service(stack)
    session = _create(service, "s", OLD)
    free = stack.allocator.available_size()
    splice = SpliceDirective(span=TokenSpan(start=20, end=50), replacement=[7, 8, 9])
    resp = _apply(service, session, [splice], 1)
    assert (resp.path, resp.revision, resp.fallback_reason) == (Path.splice, 2, None)
    assert link.prefilled == [80, 23]  # the session, then the prefix and the replacement
    # What the session's own namespace costs: a slot per token it holds, the copied
    # 20-token prefix included (all but the moved last token, which a generate computes).
    assert free - stack.allocator.available_size() == 20 + 3 + 30 - 1
    new = _tokens(service, session)
    assert new == tuple([*OLD[:20], 7, 8, 9, *OLD[50:]])
    assert resp.reused_tokens + resp.prefilled_tokens == len(new)
    # The kept downstream KV attended to the cut span: it is built in the session's own
    # namespace (the replacement's prefill named it), and the public tree matches only the
    # exact prefix, so no plain request or other session is served it.
    salt = link.salts[-1]
    assert salt is not None and salt.startswith("leyline-session-")
    ops = TreeOps(stack.tree)
    assert ops.match(list(new), salt).length == len(new) - 1  # a moved last token
    assert ops.match(list(new)).length == 20
    assert ops.match(OLD).length == len(OLD)  # the exact original stays shared

    # Deleting the session purges its namespace (in the background: the loop runs it).
    async def delete_and_settle() -> None:
        await service.delete(DEFAULT_TENANT, session)
        for _ in range(5):
            await asyncio.sleep(0)

    _run(delete_and_settle())
    assert ops.match(list(new), salt).length == 0
    assert ops.match(OLD).length == len(OLD)
    ops.tree.sanity_check()


def test_stale_revision_and_bad_span_are_typed_errors() -> None:
    stack = build("legacy")
    service, _ = _service(stack)
    session = _create(service, None, OLD)
    with pytest.raises(LeylineError) as info:
        _apply(service, session, [SpliceDirective(span=TokenSpan(start=0, end=1))], 3)
    assert info.value.code is ErrorCode.revision_conflict
    with pytest.raises(LeylineError) as info:
        _apply(service, session, [SpliceDirective(span=TokenSpan(start=0, end=99))], 1)
    assert info.value.code is ErrorCode.invalid_span
    assert _run(service.get(DEFAULT_TENANT, session)).revision == 1


def test_evicted_source_falls_back_with_its_reason() -> None:
    stack = build("unified-python")
    service, _ = _service(stack)
    session = _create(service, "s", OLD)
    TreeOps(stack.tree).evict_all()
    resp = _apply(service, session, [SpliceDirective(span=TokenSpan(start=10, end=20))], 1)
    assert (resp.path, resp.fallback_reason) == (Path.reprefill, FallbackReason.missing_source)
    assert resp.reused_tokens == 10


def test_forget_directive_purges_and_answers_reprefill() -> None:
    stack = build("legacy")
    service, _ = _service(stack)
    session = _create(service, "s", OLD)
    resp = _apply(service, session, [ForgetDirective(span=TokenSpan(start=30, end=40))], 1)
    assert (resp.path, resp.fallback_reason, resp.reused_tokens) == (Path.reprefill, None, 30)
    assert TreeOps(stack.tree).match(OLD).length == 30


SKILL = list(range(600, 624))


def test_compose_end_to_end_on_real_classes() -> None:
    """Register (a prefill, then a hold), compose at 20 with a 4-token seam: one generate
    prefills the seam in the session's own namespace and the rest is copied; a later splice
    of the composed session stays in that namespace; deleting the skill lets it go."""
    stack = build("unified-rust")
    service, link = _service(stack)
    session = _create(service, "s", OLD)
    info = _run(service.create_skill(DEFAULT_TENANT, SkillCreate(skill="rules", tokens=SKILL)))
    assert (info.num_tokens, info.model) == (len(SKILL), "sglang")
    assert stack.tree.protected_size() >= len(SKILL)  # held: eviction cannot take it
    compose = ComposeDirective(skill="rules", at=20, seam_tokens=4)
    resp = _apply(service, session, [compose], 1)
    assert (resp.path, resp.fallback_reason) == (Path.splice, None)
    assert [(b.start, b.end) for b in resp.composed] == [(20, 44)]
    assert (resp.reused_tokens, resp.prefilled_tokens) == (100, 4)
    new = _tokens(service, session)
    assert new == tuple([*OLD[:20], *SKILL, *OLD[20:]])
    salt = link.salts[-1]
    assert salt is not None and link.prefilled[-1] == 24  # the prefix and the seam
    ops = TreeOps(stack.tree)
    assert ops.match(list(new), salt).length == len(new) - 1
    assert ops.match(list(new)).length == 20  # nobody else matches the composed KV
    # Later edits of the composed session build in its namespace too.
    resp = _apply(service, session, [SpliceDirective(span=TokenSpan(start=50, end=60))], 2)
    assert (resp.path, resp.fallback_reason) == (Path.splice, None)
    newer = _tokens(service, session)
    assert ops.match(list(newer), salt).length == len(newer) - 1
    assert ops.match(list(newer)).length == 20
    _run(service.delete_skill(DEFAULT_TENANT, "rules"))
    ops.evict_all()
    assert ops.match(SKILL).length == 0


def test_compose_of_an_unknown_skill_changes_nothing() -> None:
    stack = build("legacy")
    service, _ = _service(stack)
    session = _create(service, "s", OLD)
    before = stack.snapshot()
    with pytest.raises(LeylineError) as info:
        _apply(service, session, [ComposeDirective(skill="nope", at=5)], 1)
    assert info.value.code is ErrorCode.unknown_skill
    assert _tokens(service, session) == tuple(OLD)
    after = stack.snapshot()
    assert all(torch.equal(a, b) for a, b in zip(after[0], before[0], strict=True))
    assert after[1:] == before[1:]


def test_a_cache_salt_is_sglangs_own_namespace_on_the_real_tree() -> None:
    """A session with a cache_salt lives under SGLang's ``cache_salt`` key: the public tree
    never matches it; an exact edit (nothing kept downstream) is built there too, a splice
    that keeps downstream KV in the session's own namespace."""
    stack = build("unified-python")
    service, link = _service(stack)
    body = SessionCreate(session="s", tokens=OLD, cache_salt="team-1")
    _run(service.create(DEFAULT_TENANT, body))
    assert link.salts == ["team-1"]
    ops = TreeOps(stack.tree)
    assert (ops.match(OLD, "team-1").length, ops.match(OLD).length) == (len(OLD), 0)
    resp = _apply(service, "s", [SpliceDirective(span=TokenSpan(start=60, end=80))], 1)
    assert (resp.path, resp.fallback_reason) == (Path.splice, None)
    new = _tokens(service, "s")
    assert ops.match(list(new), "team-1").length == len(new) == 60
    assert ops.match(list(new)).length == 0
    resp = _apply(service, "s", [SpliceDirective(span=TokenSpan(start=20, end=50))], 2)
    assert (resp.path, resp.fallback_reason) == (Path.splice, None)
    newer = _tokens(service, "s")
    assert ops.match(list(newer), "team-1").length == 20
    private = service.store.get(DEFAULT_TENANT, "s").handle.private_salt
    assert private is not None
    assert ops.match(list(newer), private).length == len(newer) - 1
    assert ops.match(list(newer)).length == 0


def test_a_splice_before_a_forget_keeps_its_downstream_kv_up_to_the_forget() -> None:
    """Batch rule 6: the forget purges and re-prefills from its start; the splice before it
    keeps (and rotates) the KV between the two, in the session's own namespace."""
    stack = build("unified-rust")
    service, _ = _service(stack)
    session = _create(service, "s", OLD)
    splice = SpliceDirective(span=TokenSpan(start=10, end=20), replacement=[7, 8])
    forget = ForgetDirective(span=TokenSpan(start=50, end=60))
    resp = _apply(service, session, [splice, forget], 1)
    assert (resp.path, resp.fallback_reason) == (Path.reprefill, None)
    assert resp.rotated_tokens == 30  # OLD[20:50], moved by -8
    new = _tokens(service, session)
    assert new == tuple([*OLD[:10], 7, 8, *OLD[20:50], *OLD[60:]])
    private = service.store.get(DEFAULT_TENANT, session).handle.private_salt
    assert private is not None
    ops = TreeOps(stack.tree)
    assert ops.match(list(new), private).length == len(new)  # the rest prefilled there
    assert ops.match(list(new)).length == 10
    assert ops.match(OLD).length == 50  # purged from the forget on
