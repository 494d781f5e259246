"""The server process's half: a control channel to the scheduler, and generates to prefill.

Hooked after ``TokenizerManager.init_communicators``: one more ``FanOutCommunicator`` (the
class SGLang's own control requests use) sends ``LeylineSpliceReqInput`` to the scheduler and
collects the ``LeylineSpliceReqOutput``. Then the ``/leyline/v1`` routes are mounted on
SGLang's FastAPI app, if this process serves it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from leyline.protocol import Limits

from .directive_service import DirectiveService
from .wire import LeylineSpliceReqInput, LeylineSpliceReqOutput


class TokenizerManagerLink:
    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    async def send(self, req: LeylineSpliceReqInput) -> LeylineSpliceReqOutput:
        results = await self.tm.leyline_splice_communicator(req)
        failed = [r for r in results if not r.ok]
        return failed[0] if failed else results[0]  # every rank ran it; any refusal wins

    async def prefill(self, tokens: Sequence[int]) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(tokens), sampling_params={"max_new_tokens": 1, "temperature": 0.0}
        )
        async for _ in self.tm.generate_request(obj, None):
            pass


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
        from .routes import leyline_router

        tokenizer = tokenizer_manager.tokenizer
        service = DirectiveService(
            TokenizerManagerLink(tokenizer_manager),
            lambda text: tokenizer.encode(text, add_special_tokens=False),
            Limits(max_session_tokens=int(tokenizer_manager.context_len)),
        )
        server.app.include_router(leyline_router(service))
