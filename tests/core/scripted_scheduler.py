"""A scripted stand-in for SGLang's scheduler side, for ``SglangBackend`` in ``make test``.

It keeps what the backend can observe of a radix tree: which token sequences are cached
(a prefix of a cached sequence is cached). A splice needs the old sequence cached, all but
a generation's last token (else ``missing_source``), and every inserted run prefilled (else
it asks for a prefill, as the real executor does); FORGET drops every cached sequence that
runs past the edit point. The real scheduler side runs against SGLang's own classes in
``tests/sglang`` and live in ``tests/sglang_live``; this one only drives the backend's own
logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from leyline.protocol import FallbackReason
from leyline.protocol.algebra import Edit, apply_edits
from leyline.server_adapter.core.batch import common_prefix
from leyline.server_adapter.http.turns import OnToken
from leyline.server_adapter.sampling import SamplingParams
from leyline.server_adapter.sglang.backend import SchedulerAnswer
from leyline.server_adapter.sglang.runner import Generated


class ScriptedScheduler:
    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()
        self.sent: list[str] = []
        self.prefills: list[int] = []

    def cached_length(self, tokens: Sequence[int]) -> int:
        return max((common_prefix(seq, tokens) for seq in self.cached), default=0)

    async def prefill(self, tokens: Sequence[int]) -> None:
        self.prefills.append(len(tokens))
        self.cached.add(tuple(tokens))

    async def send(
        self, verb: str, old_tokens: Sequence[int], edits: Sequence[Edit]
    ) -> SchedulerAnswer:
        self.sent.append(verb)
        old = tuple(old_tokens)
        if verb == "forget":
            cut = min(e.start for e in edits)
            self.cached = {seq for seq in self.cached if common_prefix(seq, old) <= cut}
            self.cached.add(old[:cut])
            return SchedulerAnswer(ok=True, cached_tokens=cut)
        if self.cached_length(old) < len(old) - 1:  # a generation's last token has no KV
            return SchedulerAnswer(
                ok=False, fallback_reason=FallbackReason.missing_source, message="evicted"
            )
        result = apply_edits(old, edits)
        for run in result.runs:
            if (
                run.kind != "kept"
                and self.cached_length(result.tokens[: run.new_end]) < run.new_end
            ):
                return SchedulerAnswer(ok=True, pending_prefill=run.new_end + 1)
        self.cached.add(result.tokens)
        return SchedulerAnswer(
            ok=True,
            cached_tokens=len(result.tokens),
            reused_tokens=result.reused_tokens,
            rotated_tokens=result.rotated_tokens,
        )


class ScriptedGenerator:
    """A scripted stand-in for SGLang's generate: always the same ids (the last one a stop
    id), and as cached as the scripted tree says; it then caches the prompt and the ids."""

    def __init__(
        self,
        scheduler: ScriptedScheduler,
        ids: Sequence[int],
        stop_id: int,
        decode: Callable[[Sequence[int]], str],
    ) -> None:
        self.scheduler = scheduler
        self.decode = decode
        self.ids = (*ids, stop_id)
        self.prompts: list[tuple[int, ...]] = []

    async def generate(
        self, tokens: Sequence[int], params: SamplingParams, on_token: OnToken
    ) -> Generated:
        prompt = tuple(tokens)
        self.prompts.append(prompt)
        cached = min(self.scheduler.cached_length(prompt), len(prompt) - 1)
        out: list[int] = []
        for token in self.ids[: params.max_new_tokens]:
            out.append(token)
            if not on_token(token):
                break
        self.scheduler.cached.add(prompt + tuple(out[:-1]))
        finish = "stop" if out[-1] == self.ids[-1] else "length"
        text = self.decode([t for t in out if t != self.ids[-1]])
        return Generated(tuple(out), text, finish, cached)
