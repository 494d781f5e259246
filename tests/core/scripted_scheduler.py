"""A scripted stand-in for SGLang's scheduler side, for ``SglangBackend`` in ``make test``.

It keeps what the backend can observe of a radix tree: which token sequences are cached,
per namespace (``cache_salt``; a prefix of a cached sequence is cached), and which are
held. A splice needs the old sequence cached, all but a generation's last token (else
``missing_source``), and every inserted token prefilled in the new namespace (else it asks
for a prefill, as the real executor does) except a composed block's tokens past its seam
that the tree holds for its skill; FORGET drops every cached sequence of the namespace that
runs past the edit point. The real scheduler side runs against SGLang's own classes in
``tests/sglang`` and live in ``tests/live``; this one only drives the backend's own
logic.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from leyline.core.batch import common_prefix
from leyline.core.turns import OnToken, SamplingParams
from leyline.protocol import ErrorCode, FallbackReason
from leyline.protocol.algebra import apply_edits
from leyline.protocol.directives import Mode
from leyline.sglang.link import Generated, SchedulerAnswer, SchedulerOrder


class ScriptedScheduler:
    def __init__(self, *, hold_cap: int = 1 << 20) -> None:
        self.caches: dict[str | None, set[tuple[int, ...]]] = {None: set()}
        self.held: dict[str, tuple[int, ...]] = {}
        self.hold_cap = hold_cap
        self.sent: list[str] = []
        self.prefills: list[int] = []

    @property
    def cached(self) -> set[tuple[int, ...]]:
        """The public namespace's cached sequences."""
        return self.caches[None]

    def cache(self, salt: str | None) -> set[tuple[int, ...]]:
        return self.caches.setdefault(salt, set())

    def cached_length(self, tokens: Sequence[int], salt: str | None = None) -> int:
        return max((common_prefix(seq, tokens) for seq in self.cache(salt)), default=0)

    async def prefill(self, tokens: Sequence[int], salt: str | None = None) -> None:
        self.prefills.append(len(tokens))
        self.cache(salt).add(tuple(tokens))

    def _hold(self, order: SchedulerOrder) -> SchedulerAnswer:
        key, tokens = order.key, tuple(order.old_tokens)
        others = {k: len(t) for k, t in self.held.items() if k != key}
        over = sum(others.values()) + len(tokens) - self.hold_cap
        released: list[str] = []
        for victim in order.evictable:
            if over > 0 and victim in others:
                released.append(victim)
                over -= others[victim]
        if over > 0:
            return SchedulerAnswer(
                ok=False,
                error_code=ErrorCode.limit_exceeded.value,
                error_field="tokens",
                message="no room to hold it",
            )
        for victim in released:
            del self.held[victim]
        held = self.cached_length(tokens, order.old_salt)
        self.held[key] = tokens[:held]
        return SchedulerAnswer(ok=True, cached_tokens=held, released=tuple(released))

    async def send(self, order: SchedulerOrder) -> SchedulerAnswer:
        self.sent.append(order.verb)
        if order.verb == "hold":
            return self._hold(order)
        if order.verb == "release":
            self.held.pop(order.key, None)
            return SchedulerAnswer(ok=True)
        old, edits, blocks = tuple(order.old_tokens), order.edits, order.blocks
        old_salt, new_salt = order.old_salt, order.new_salt
        if order.verb == "forget":
            forgets = [e.start for e in edits if e.mode is Mode.forget]
            cut = min(forgets or [e.start for e in edits])
            kept = {seq for seq in self.cache(old_salt) if common_prefix(seq, old) <= cut}
            self.caches[old_salt] = kept | {old[:cut]}
            return SchedulerAnswer(ok=True, cached_tokens=cut)
        if self.cached_length(old, old_salt) < len(old) - 1:  # a last token has no KV
            return SchedulerAnswer(
                ok=False, fallback_reason=FallbackReason.missing_source, message="evicted"
            )
        result = apply_edits(old, edits)
        new = result.tokens
        copied = set()
        for b in blocks:
            body_end = b.start + max(0, self.cached_length(b.source, b.salt) - b.offset)
            copied |= set(range(b.start + b.seam, min(b.end, body_end)))
        for run in result.runs:
            if run.kind == "kept":
                continue
            for p in range(run.new_start, run.new_end):
                if p not in copied and self.cached_length(new[: p + 1], new_salt) <= p:
                    self.cache(new_salt).add(new[:p])  # what the build got to
                    return SchedulerAnswer(ok=True, pending_prefill=run.new_end)
        self.cache(new_salt).add(new)
        return SchedulerAnswer(
            ok=True,
            cached_tokens=len(new),
            reused_tokens=result.reused_tokens + len(copied),
            rotated_tokens=result.rotated_tokens + (len(copied) if blocks else 0),
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
        self.salts: list[str | None] = []

    async def generate(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        on_token: OnToken,
        salt: str | None = None,
    ) -> Generated:
        prompt = tuple(tokens)
        self.prompts.append(prompt)
        self.salts.append(salt)
        cached = min(self.scheduler.cached_length(prompt, salt), len(prompt) - 1)
        out: list[int] = []
        for token in self.ids[: params.max_new_tokens]:
            out.append(token)
            if not on_token(token):
                break
        self.scheduler.cache(salt).add(prompt + tuple(out[:-1]))
        finish = "stop" if out[-1] == self.ids[-1] else "length"
        text = self.decode([t for t in out if t != self.ids[-1]])
        return Generated(tuple(out), text, finish, cached)
