"""The server process's half: a control channel to the scheduler, and generates to prefill.

Hooked after ``TokenizerManager.init_communicators``: one more ``FanOutCommunicator`` (the
class SGLang's own control requests use) sends ``LeylineSpliceReqInput`` to the scheduler and
collects the ``LeylineSpliceReqOutput``. Then the session core's ``/leyline/v1`` routes, over
an ``SglangBackend``, are mounted on SGLang's FastAPI app, if this process serves it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from leyline.protocol import Limits
from leyline.protocol.algebra import Edit

from ..core.routes import leyline_router
from ..core.service import SessionService
from ..core.sessions import SessionStore
from .backend import SchedulerAnswer, SglangBackend
from .wire import LeylineSpliceReqOutput, from_wire, to_wire


class TokenizerManagerLink:
    """``SchedulerLink`` over SGLang's IPC: control requests and ordinary generates."""

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    async def send(
        self, verb: str, old_tokens: Sequence[int], edits: Sequence[Edit]
    ) -> SchedulerAnswer:
        req = to_wire(verb, old_tokens, edits)
        results: list[LeylineSpliceReqOutput] = await self.tm.leyline_splice_communicator(req)
        failed = [r for r in results if not r.ok]
        return from_wire(failed[0] if failed else results[0])  # any rank's refusal wins

    async def prefill(self, tokens: Sequence[int]) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(tokens), sampling_params={"max_new_tokens": 1, "temperature": 0.0}
        )
        async for _ in self.tm.generate_request(obj, None):
            pass


def backend_for(tokenizer_manager: Any) -> SglangBackend:
    """The session core's backend for this server: its tokenizer, vocabulary and context."""
    config = tokenizer_manager.model_config
    name = getattr(tokenizer_manager, "served_model_name", None) or ""
    return SglangBackend(
        TokenizerManagerLink(tokenizer_manager),
        tokenizer_manager.tokenizer,  # None with --skip-tokenizer-init: token ids only
        limits=Limits(max_session_tokens=int(tokenizer_manager.context_len)),
        vocab_size=int(config.vocab_size),
        model_name=str(name),
    )


def install(tokenizer_manager: Any) -> None:
    from sglang.srt.managers.communicator import FanOutCommunicator
    from sglang.srt.runtime_context import get_parallel
    from sglang.utils import TypeBasedDispatcher

    if get_parallel().num_dp_ranks != 1:
        return  # each DP rank has its own tree; sessions are not routed: not served (docs)
    comm = FanOutCommunicator(tokenizer_manager._dispatch_to_scheduler, 1)
    tokenizer_manager.leyline_splice_communicator = comm
    tokenizer_manager._result_dispatcher += TypeBasedDispatcher(
        [(LeylineSpliceReqOutput, comm.handle_recv)]
    )
    server = sys.modules.get("sglang.srt.entrypoints.http_server")
    if server is not None and getattr(server, "app", None) is not None:
        backend = backend_for(tokenizer_manager)
        service = SessionService(backend, SessionStore(backend))
        server.app.include_router(leyline_router(service))
