"""The server process's half: a control channel to the scheduler, and generates to prefill.

Hooked after ``TokenizerManager.init_communicators``: one more ``FanOutCommunicator`` (the
class SGLang's own control requests use) sends ``LeylineSpliceReqInput`` to the scheduler and
collects the ``LeylineSpliceReqOutput``. Then the session core's ``/leyline/v1`` routes, over
an ``SglangBackend``, are mounted on SGLang's FastAPI app, if this process serves it, with
chat and completions requests that carry a ``leyline`` object (``openai_dispatch``);
their generations are ordinary streamed generates (``TokenizerManagerLink.generate``).
"""

from __future__ import annotations

import secrets
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from leyline.core.route_guard import unmatched_router
from leyline.core.routes import leyline_router
from leyline.core.salted_session import SaltedSession
from leyline.core.turns import OnToken, SamplingParams, TokenChoice
from leyline.protocol import Limits
from leyline.protocol.resources import API_PREFIX
from leyline.serve.openai_dispatch import LeylineDispatch, leyline_openai_app
from leyline.serve.service import LeylineService
from leyline.serve.settings import ServerSettings
from leyline.serve.tenant_keys import TenantKeys, tenants_from_env
from leyline.serve.tunnel import LeylineTunnel
from leyline.serve.worker import WorkerName, worker_name_from_env
from leyline.sglang.backend import SglangBackend
from leyline.sglang.link import Generated, SchedulerAnswer, SchedulerOrder
from leyline.sglang.wire import LeylineSpliceReqInput, LeylineSpliceReqOutput, from_wire, to_wire


class TokenizerManagerLink:
    """``SchedulerLink`` over SGLang's IPC: control requests and ordinary generates."""

    def __init__(self, tokenizer_manager: Any) -> None:
        self.tm = tokenizer_manager

    async def send(self, order: SchedulerOrder) -> SchedulerAnswer:
        return await self._ask(to_wire(order))

    async def _ask(self, req: LeylineSpliceReqInput) -> SchedulerAnswer:
        results: list[LeylineSpliceReqOutput] = await self.tm.leyline_splice_communicator(req)
        failed = [r for r in results if not r.ok]
        return from_wire(failed[0] if failed else results[0])  # any rank's refusal wins

    async def prefill(self, tokens: Sequence[int], salt: str | None = None) -> None:
        from sglang.srt.managers.io_struct import GenerateReqInput

        obj = GenerateReqInput(
            input_ids=list(tokens),
            sampling_params={"max_new_tokens": 1, "temperature": 0.0},
            cache_salt=salt,
        )
        async for _ in self.tm.generate_request(obj, None):
            pass

    async def generate(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        on_token: OnToken,
        salt: str | None = None,
    ) -> Generated:
        """An ordinary streamed generate of ``tokens`` (in cache namespace ``salt``); stopped
        (aborted) when ``on_token`` says so, e.g. because the client went away."""
        from sglang.srt.managers.io_struct import GenerateReqInput

        top = params.logprobs
        obj = GenerateReqInput(
            input_ids=list(tokens),
            sampling_params=sampling_params(params),
            rid=f"leyline-{uuid.uuid4().hex}",
            stream=True,
            return_logprob=top is not None,
            top_logprobs_num=top or 0,
            logprob_start_len=-1,
            cache_salt=salt,
        )
        incremental = bool(getattr(self.tm, "incremental_streaming_output", False))
        ids: list[int] = []
        pieces: list[str] = []
        choices: list[TokenChoice] = []
        last: dict[str, Any] = {}
        stopped = False
        async for out in self.tm.generate_request(obj, None):
            last = out
            new = list(out.get("output_ids") or [])
            new = new if incremental else new[len(ids) :]
            if incremental:  # text and logprobs come as deltas too
                pieces.append(out["text"] if isinstance(out.get("text"), str) else "")
                choices.extend(_choices(out.get("meta_info", {})) if top is not None else ())
            for token in new:
                ids.append(int(token))
                if not stopped and not on_token(int(token)):
                    stopped = True
            if stopped:
                self.tm.abort_request(rid=obj.rid)
                break
        meta = last.get("meta_info", {})
        finish = meta.get("finish_reason") or {}
        # SGLang's own text (special tokens skipped, a stop string cut), unless it stopped
        # early on our side: then what was generated so far.
        text = "".join(pieces) if incremental else last.get("text")
        if stopped or not isinstance(text, str):
            tokenizer = self.tm.tokenizer
            text = tokenizer.decode(ids, skip_special_tokens=True) if tokenizer else ""
        return Generated(
            ids=tuple(ids),
            text=text,
            finish_reason="length" if finish.get("type") == "length" else "stop",
            cached_tokens=int(meta.get("cached_tokens", 0)),
            logprobs=tuple(choices) if incremental else _choices(meta) if top is not None else (),
        )


def sampling_params(params: SamplingParams) -> dict[str, Any]:
    """Leyline's checked sampling fields as SGLang's ``sampling_params``."""
    out: dict[str, Any] = {
        "max_new_tokens": params.max_new_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p if params.top_p is not None else 1.0,
    }
    if params.top_k is not None:
        out["top_k"] = params.top_k
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    if params.stop:
        out["stop"] = list(params.stop)
    if params.stop_token_ids is not None:
        out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def _choices(meta: dict[str, Any]) -> tuple[TokenChoice, ...]:
    """SGLang's ``(logprob, id, text)`` triples as Leyline's token choices."""
    chosen = meta.get("output_token_logprobs") or []
    tops = meta.get("output_top_logprobs") or [[] for _ in chosen]
    return tuple(
        TokenChoice(int(c[1]), float(c[0]), tuple((int(t[1]), float(t[0])) for t in top or []))
        for c, top in zip(chosen, tops, strict=False)
    )


def backend_for(tokenizer_manager: Any, *, tenants: bool = False) -> SglangBackend:
    """The session core's backend for this server: its tokenizer, vocabulary and context;
    with ``tenants``, each tenant's KV in namespaces derived with a secret of this process
    (sessions live in this process only, so the names need not outlive it)."""
    config = tokenizer_manager.model_config
    name = getattr(tokenizer_manager, "served_model_name", None) or ""
    link = TokenizerManagerLink(tokenizer_manager)
    return SglangBackend(
        link,
        tokenizer_manager.tokenizer,  # None with --skip-tokenizer-init: token ids only
        # SGLang refuses an input of context_len tokens or more (a ValueError, not a
        # typed error): sessions and skills stay below it.
        limits=Limits(
            max_session_tokens=int(tokenizer_manager.context_len) - 1,
            max_skill_tokens=int(tokenizer_manager.context_len) - 1,
        ),
        vocab_size=int(config.vocab_size),
        model_name=str(name),
        tenant_secret=secrets.token_bytes(32) if tenants else None,
        generator=link,
        stop_token_ids=_stop_ids(tokenizer_manager),
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
        mount(server.app, tokenizer_manager)


def mount(app: Any, tokenizer_manager: Any) -> LeylineService[SaltedSession]:
    """The ``/leyline/v1`` routes, and chat / completions with a ``leyline`` object, on
    SGLang's FastAPI ``app``: one service, so a session made by either is seen by both."""
    tenants = tenants_from_env()  # a malformed keys file stops the server here, loudly
    worker_name = worker_name_from_env()  # so does a name that is no header value
    backend = backend_for(tokenizer_manager, tenants=tenants is not None)
    service = LeylineService(backend, ServerSettings(), model_name=backend.model_name)
    routes = leyline_router(service.core)
    app.include_router(routes)
    # SGLang's own router answers paths it does not know in FastAPI's format; under
    # /leyline/v1 the protocol's body is due (last: it must not shadow a route there).
    app.include_router(unmatched_router(API_PREFIX, routes))
    leyline_app: Any = leyline_openai_app(service)
    if tenants is not None:
        # Keys where the plugin answers; SGLang's own routes keep its own --api-key.
        app.add_middleware(TenantKeys, tenants=tenants, prefix=API_PREFIX)
        leyline_app = TenantKeys(leyline_app, tenants=tenants)
    app.add_middleware(LeylineDispatch, leyline_app=leyline_app)
    app.add_middleware(LeylineTunnel)  # an envelope's request meets the rest
    if worker_name is not None:
        # Outermost, on SGLang's own routes too: behind a router, a client sees who answered.
        app.add_middleware(WorkerName, name=worker_name)
    return service


def _stop_ids(tokenizer_manager: Any) -> tuple[int, ...]:
    """The ids that end a generation by default (the model's end-of-sequence ids)."""
    ids = getattr(tokenizer_manager.model_config, "hf_eos_token_id", None) or set()
    tokenizer = tokenizer_manager.tokenizer
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = set(ids) | {int(tokenizer.eos_token_id)}
    return tuple(sorted(int(i) for i in ids))
