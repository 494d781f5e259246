"""Orders the vLLM backend attaches to its own requests, and the connector's answers (no vLLM
import): plain dataclasses, to and from the JSON-able payload of a ``kv_hints`` action.

An order travels as one ``KvHintAction`` of type :data:`ORDER_ACTION` on a request the
backend runs itself (no HTTP route can set ``kv_hints``, so plain clients cannot forge one).
The scheduler-side connector reads it once, when the request is added; the answer comes
back from ``request_finished`` as ``kv_transfer_params[ANSWER_KEY]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from leyline.protocol.algebra import PositionMap

ORDER_ACTION = "leyline.order"
ORDER_VERSION = "1"
ANSWER_KEY = "leyline"


def _int(payload: Mapping[str, Any], key: str, *, low: int = 0) -> int:
    value = payload.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{key!r} must be an integer >= {low}, got {value!r}")
    return value


def _salt(payload: Mapping[str, Any]) -> str | None:
    value = payload.get("salt")
    if value is not None and not isinstance(value, str):
        raise ValueError(f"'salt' must be a string or null, got {value!r}")
    return value


def _tokens(payload: Mapping[str, Any]) -> tuple[int, ...]:
    value = payload.get("tokens")
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise ValueError("'tokens' must be a list of integers")
    return tuple(value)


def _items(payload: Mapping[str, Any], key: str) -> list[Mapping[str, Any]]:
    value = payload.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, Mapping) for v in value):
        raise ValueError(f"{key!r} must be a list of objects")
    return value


@dataclass(frozen=True, slots=True)
class RowRun:
    """Destination positions ``[dest_start, dest_start + length)`` read from the source's
    positions ``[source_start, ...)``, keys rotated by :attr:`shift`."""

    source_start: int
    dest_start: int
    length: int

    @property
    def shift(self) -> int:
        """Positions each row moves (a key cached at ``p`` is wanted at ``p + shift``)."""
        return self.dest_start - self.source_start

    def to_payload(self) -> dict[str, int]:
        return {"source": self.source_start, "dest": self.dest_start, "length": self.length}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> RowRun:
        return cls(_int(payload, "source"), _int(payload, "dest"), _int(payload, "length", low=1))


def runs_of(position_map: PositionMap) -> tuple[RowRun, ...]:
    """The rows an edit keeps: each surviving old position to its new one."""
    return tuple(
        RowRun(run.old_start, run.new_start, len(run))
        for run in position_map.runs
        if run.old_start is not None and len(run) > 0
    )


@dataclass(frozen=True, slots=True)
class LoadSource:
    """A cached sequence (``tokens`` under ``salt``), or a held skill's blocks (``hold``, a
    key of :class:`HoldOrder`; then ``salt`` and ``tokens`` are unused), and the rows read
    from it (source positions count from the start of what is cached or held)."""

    salt: str | None
    tokens: tuple[int, ...]
    runs: tuple[RowRun, ...]
    hold: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return {
            "salt": self.salt,
            "tokens": list(self.tokens),
            "runs": [run.to_payload() for run in self.runs],
            "hold": self.hold,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> LoadSource:
        hold = payload.get("hold")
        if hold is not None and not isinstance(hold, str):
            raise ValueError(f"'hold' must be a string or null, got {hold!r}")
        source = cls(
            _salt(payload),
            _tokens(payload),
            tuple(RowRun.from_payload(r) for r in _items(payload, "runs")),
            hold,
        )
        for run in source.runs:
            # A hold's length is known to the scheduler only: rows past it are missing.
            if hold is None and run.source_start + run.length > len(source.tokens):
                raise ValueError(f"{run} reads past the source's {len(source.tokens)} tokens")
        return source


@dataclass(frozen=True, slots=True)
class PurgeTarget:
    """Evict the cached blocks of ``tokens`` under ``salt`` from the one holding
    ``from_position`` on."""

    salt: str | None
    tokens: tuple[int, ...]
    from_position: int

    def to_payload(self) -> dict[str, Any]:
        return {"salt": self.salt, "tokens": list(self.tokens), "from": self.from_position}

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> PurgeTarget:
        return cls(_salt(payload), _tokens(payload), _int(payload, "from"))


def _keys(payload: Mapping[str, Any], key: str) -> tuple[str, ...]:
    value = payload.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must be a list of strings")
    return tuple(value)


@dataclass(frozen=True, slots=True)
class HoldOrder:
    """Keep the blocks holding the first :attr:`rows` tokens of the request that carries
    this order (a skill's prefill) out of eviction under :attr:`key`, until released.

    The scheduler holds at most a quarter of its blocks: past that it releases the
    :attr:`evictable` holds (idle skills, least recently used first) until the new one
    fits, or refuses it, releasing nothing. :attr:`replaces` (a replaced skill's key) is
    released once the new hold is taken, and does not count against the room."""

    key: str
    rows: int
    evictable: tuple[str, ...] = ()
    replaces: str | None = None

    def to_payload(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "rows": self.rows,
            "evictable": list(self.evictable),
            "replaces": self.replaces,
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> HoldOrder:
        key, replaces = payload.get("key"), payload.get("replaces")
        if not isinstance(key, str) or (replaces is not None and not isinstance(replaces, str)):
            raise ValueError("a hold needs a string 'key' ('replaces': a string or null)")
        return cls(key, _int(payload, "rows", low=1), _keys(payload, "evictable"), replaces)


@dataclass(frozen=True, slots=True)
class Order:
    """One request's order: holds to release and blocks to purge first, rows to load before
    its forward, and a hold of its own blocks once it has run."""

    load: tuple[LoadSource, ...] = ()
    purge: tuple[PurgeTarget, ...] = ()
    hold: HoldOrder | None = None
    release: tuple[str, ...] = ()
    """Hold keys to release (a deleted skill's)."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "load": [source.to_payload() for source in self.load],
            "purge": [target.to_payload() for target in self.purge],
            "hold": None if self.hold is None else self.hold.to_payload(),
            "release": list(self.release),
        }

    @classmethod
    def from_payload(cls, payload: Mapping[str, Any]) -> Order:
        """The order in ``payload``; ``ValueError`` when it is malformed or two runs write
        the same destination position."""
        hold = payload.get("hold")
        if hold is not None and not isinstance(hold, Mapping):
            raise ValueError("'hold' must be an object or null")
        order = cls(
            tuple(LoadSource.from_payload(s) for s in _items(payload, "load")),
            tuple(PurgeTarget.from_payload(t) for t in _items(payload, "purge")),
            None if hold is None else HoldOrder.from_payload(hold),
            _keys(payload, "release"),
        )
        spans = sorted(
            (run.dest_start, run.dest_start + run.length) for s in order.load for run in s.runs
        )
        for (_, end), (start, _) in itertools.pairwise(spans):
            if start < end:
                raise ValueError(f"two runs write destination position {start}")
        return order


def order_from_actions(actions: Iterable[Any]) -> Order | None:
    """The order among a request's ``kv_hints`` actions (objects with ``action_type``,
    ``action_version`` and ``payload``), or None when it carries none."""
    found = [a for a in actions if getattr(a, "action_type", None) == ORDER_ACTION]
    if not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{len(found)} {ORDER_ACTION} actions on one request")
    action = found[0]
    if action.action_version != ORDER_VERSION:
        raise ValueError(f"order version {action.action_version!r}, not {ORDER_VERSION!r}")
    return Order.from_payload(action.payload)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the connector did with one request's order."""

    reused: int = 0
    """Rows the connector loaded (moved bitwise or rotated)."""
    rotated: int = 0
    """Of those, rows whose keys were rotated (shift != 0)."""
    missing_from: int | None = None
    """The first destination position not loaded because its source block was gone."""
    fallback_reason: str | None = None
    """A protocol fallback reason: the order did not run (or not all of it)."""
    purged_blocks: int = 0
    message: str = ""
    held: int = 0
    """Rows the order's hold keeps (0: none taken)."""
    hold_error: str | None = None
    """Why the hold was not taken, an error code (``limit_exceeded``: no room even with
    every evictable hold released; ``splice_refused``: the connector takes no orders)."""
    released: tuple[str, ...] = ()
    """Hold keys released to make room for the order's hold (idle skills evicted)."""

    def to_payload(self) -> dict[str, Any]:
        return {
            "reused": self.reused,
            "rotated": self.rotated,
            "missing_from": self.missing_from,
            "fallback_reason": self.fallback_reason,
            "purged_blocks": self.purged_blocks,
            "message": self.message,
            "held": self.held,
            "hold_error": self.hold_error,
            "released": list(self.released),
        }

    @classmethod
    def from_params(cls, kv_transfer_params: Mapping[str, Any] | None) -> Answer | None:
        """The answer in a request output's ``kv_transfer_params``, if any."""
        payload = (kv_transfer_params or {}).get(ANSWER_KEY)
        if payload is None:
            return None
        missing = payload.get("missing_from")
        return cls(
            reused=_int(payload, "reused"),
            rotated=_int(payload, "rotated"),
            missing_from=None if missing is None else _int(payload, "missing_from"),
            fallback_reason=payload.get("fallback_reason"),
            purged_blocks=_int(payload, "purged_blocks"),
            message=str(payload.get("message", "")),
            held=int(payload.get("held") or 0),
            hold_error=payload.get("hold_error"),
            released=_keys(payload, "released"),
        )


@dataclass(frozen=True, slots=True)
class RowMoves:
    """One step's rows to load: ``(src_blocks[i], src_offsets[i])`` ->
    ``(dst_blocks[i], dst_offsets[i])``, keys rotated by ``shifts[i]`` positions."""

    src_blocks: tuple[int, ...] = ()
    src_offsets: tuple[int, ...] = ()
    dst_blocks: tuple[int, ...] = ()
    dst_offsets: tuple[int, ...] = ()
    shifts: tuple[int, ...] = ()

    def __len__(self) -> int:
        return len(self.dst_blocks)

    @classmethod
    def of(cls, rows: Sequence[tuple[int, int, int, int, int]]) -> RowMoves:
        """From ``(src block, src offset, dst block, dst offset, shift)`` rows."""
        if not rows:
            return cls()
        columns = tuple(zip(*rows, strict=True))
        return cls(*columns)
