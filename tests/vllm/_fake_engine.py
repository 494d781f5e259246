"""A stand-in for vLLM's engine behind ``VllmBackend``'s ``Runner``: its prefix cache (full
blocks under chained (salt, tokens) keys), the connector's load (consecutive planned rows
from the hit on, while their source block is cached, never the last prompt token), its
purge, and skill holds (a request's rows kept by key, released by key; at most
``hold_blocks`` blocks, idle holds released first). Each position's KV is recorded as where
it came from, so a test can tell a row loaded (and from where) from one computed, and as a
symbolic value (``Value``): a computed row is its token at its position over the values
before it, a loaded row its source's value rotated by the shift, so two ways of building a
sequence can be compared row by row."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from leyline.core.turns import OnToken, SamplingParams
from leyline.vllm.link import Answer, HoldOrder, Order
from leyline.vllm.runner import Ran

Key = tuple[str | None, tuple[int, ...]]
"""A full block: the salt and every token up to its end (vLLM's chained hash)."""

Value = tuple[object, ...]
"""A row's KV, symbolically: ``("computed", token, position, context)`` where ``context``
identifies the values before it, or ``("rotated", value, shift)``."""


def computed_value(token: int, position: int, before: Sequence[Value]) -> Value:
    return ("computed", token, position, hash(tuple(before)))


def rotated_value(value: Value, shift: int) -> Value:
    """``value`` with its key rotated by ``shift`` (rotations add up; a net 0 is the row)."""
    if value[0] == "rotated":
        value, shift = value[1], shift + value[2]  # type: ignore[assignment,operator]
    return value if shift == 0 else ("rotated", value, shift)


@dataclass
class Request:
    tokens: tuple[int, ...]
    salt: str | None
    order: Order | None
    kv: list[str]
    """Per position: 'computed' or 'loaded <salt> <source position> <shift>' or 'hit'."""
    answer: Answer | None
    values: list[Value] = field(default_factory=list)


@dataclass
class FakeEngine:
    block_size: int = 4
    cache: dict[Key, list[str]] = field(default_factory=dict)
    values: dict[Key, list[Value]] = field(default_factory=dict)
    """Each cached block's rows as values (read only while ``cache`` holds the block)."""
    requests: list[Request] = field(default_factory=list)
    output: tuple[int, ...] = (7,)
    holds: dict[str, list[Value]] = field(default_factory=dict)
    """A held request's rows (as values), by hold key."""
    hold_blocks: int = 1000

    def cached_blocks(self, salt: str | None, tokens: Sequence[int]) -> int:
        n = 0
        while (salt, tuple(tokens[: (n + 1) * self.block_size])) in self.cache and (
            n + 1
        ) * self.block_size <= len(tokens):
            n += 1
        return n

    def value(self, salt: str | None, tokens: Sequence[int], position: int) -> Value:
        """The value of row ``position`` of ``tokens`` cached under ``salt``."""
        b = self.block_size
        return self.values[(salt, tuple(tokens[: (position // b + 1) * b]))][position % b]

    async def run(
        self,
        tokens: Sequence[int],
        params: SamplingParams,
        salt: str | None,
        order: Order | None = None,
        on_token: OnToken | None = None,
    ) -> Ran:
        tokens = tuple(tokens)
        b = self.block_size
        purged = 0
        for key in order.release if order else ():
            self.holds.pop(key, None)
        for target in order.purge if order else ():
            first = target.from_position // b
            for k in range(first, len(target.tokens) // b):
                purged += (
                    self.cache.pop((target.salt, target.tokens[: (k + 1) * b]), None) is not None
                )
        hit = min(self.cached_blocks(salt, tokens) * b, (len(tokens) - 1) // b * b)
        kv = ["hit"] * hit
        values = [self.value(salt, tokens, p) for p in range(hit)]
        reused = rotated = 0
        missing = None
        rows = _rows(order)
        while len(kv) < len(tokens) - 1 and len(kv) in rows:
            source_salt, source_tokens, at, shift, hold = rows[len(kv)]
            if hold is not None:
                if at >= len(self.holds.get(hold, ())):
                    missing = len(kv)
                    break
                kv.append(f"held {hold} {at} {shift}")
                values.append(rotated_value(self.holds[hold][at], shift))
                reused += 1
                rotated += shift != 0
                continue
            if self.cached_blocks(source_salt, source_tokens) * b <= at:
                missing = len(kv)
                break
            kv.append(f"loaded {source_salt} {at} {shift}")
            values.append(rotated_value(self.value(source_salt, source_tokens, at), shift))
            reused += 1
            rotated += shift != 0
        kv += ["computed"] * (len(tokens) - len(kv))
        for p in range(len(values), len(tokens)):
            values.append(computed_value(tokens[p], p, values))
        for k in range(len(tokens) // b):
            key = (salt, tokens[: (k + 1) * b])
            if key not in self.cache:
                self.cache[key] = kv[k * b : (k + 1) * b]
                self.values[key] = values[k * b : (k + 1) * b]
        answer = None
        if order is not None:
            reason = "missing_source" if missing is not None else None
            answer = Answer(reused, rotated, missing, reason, purged)
            if order.hold is not None:
                answer = self._hold(order.hold, values, answer)
        self.requests.append(Request(tokens, salt, order, kv, answer, values))
        ids = self.output[: params.max_new_tokens]
        return Ran(ids, "x" * len(ids), "length", hit + reused, answer)

    def _hold(self, hold: HoldOrder, values: list[Value], answer: Answer) -> Answer:
        blocks = {k: -(-len(v) // self.block_size) for k, v in self.holds.items()}
        need = -(-hold.rows // self.block_size)
        used = sum(n for k, n in blocks.items() if k not in (hold.key, hold.replaces))
        released = []
        for key in hold.evictable:
            if used + need <= self.hold_blocks:
                break
            if key in blocks and key not in (hold.key, hold.replaces):
                released.append(key)
                used -= blocks[key]
        if used + need > self.hold_blocks:
            return replace(answer, hold_error="limit_exceeded", message="no room")
        for key in (*released, hold.replaces):
            self.holds.pop(key or "", None)
        self.holds[hold.key] = values[: hold.rows]
        return replace(answer, held=hold.rows, released=tuple(released))


def _rows(
    order: Order | None,
) -> dict[int, tuple[str | None, tuple[int, ...], int, int, str | None]]:
    rows = {}
    for source in order.load if order else ():
        for run in source.runs:
            for k in range(run.length):
                at = run.source_start + k
                rows[run.dest_start + k] = (source.salt, source.tokens, at, run.shift, source.hold)
    return rows
