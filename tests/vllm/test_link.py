"""``link``: orders and answers survive the ``kv_hints`` payload round trip; malformed orders
are refused; an edit's position map becomes its row runs."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from leyline.protocol.algebra import Edit, apply_edits
from leyline.vllm.link import (
    ANSWER_KEY,
    ORDER_ACTION,
    ORDER_VERSION,
    Answer,
    LoadSource,
    Order,
    PurgeTarget,
    RowMoves,
    RowRun,
    order_from_actions,
    runs_of,
)

ORDER = Order(
    load=(LoadSource("s", (1, 2, 3, 4), (RowRun(0, 0, 2), RowRun(3, 5, 1))),),
    purge=(PurgeTarget(None, (9, 8), 1),),
)


def _action(payload: Any, kind: str = ORDER_ACTION, version: str = ORDER_VERSION) -> Any:
    return SimpleNamespace(action_type=kind, action_version=version, payload=payload)


def test_an_order_round_trips_through_json() -> None:
    payload = json.loads(json.dumps(ORDER.to_payload()))
    assert order_from_actions([_action({}, kind="other"), _action(payload)]) == ORDER
    assert order_from_actions([_action({}, kind="other")]) is None
    assert ORDER.load[0].runs[1].shift == 2


@pytest.mark.parametrize(
    "payload",
    [
        {"load": [{"salt": 3, "tokens": [1], "runs": []}]},
        {"load": [{"salt": None, "tokens": [1, "x"], "runs": []}]},
        {
            "load": [
                {"salt": None, "tokens": [1, 2], "runs": [{"source": 1, "dest": 0, "length": 2}]}
            ]
        },
        {"load": [{"salt": None, "tokens": [1], "runs": [{"source": 0, "dest": 0, "length": 0}]}]},
        {"purge": [{"salt": None, "tokens": [1], "from": -1}]},
        {
            "load": [
                {"salt": "a", "tokens": [1, 2], "runs": [{"source": 0, "dest": 0, "length": 2}]},
                {"salt": "b", "tokens": [1, 2], "runs": [{"source": 0, "dest": 1, "length": 1}]},
            ]
        },
    ],
)
def test_malformed_orders_are_refused(payload: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        order_from_actions([_action(payload)])


def test_two_orders_or_another_version_are_refused() -> None:
    with pytest.raises(ValueError):
        order_from_actions([_action({}), _action({})])
    with pytest.raises(ValueError):
        order_from_actions([_action({}, version="0")])


def test_an_edits_position_map_becomes_its_row_runs() -> None:
    result = apply_edits(tuple(range(10)), [Edit(2, 4, (50,)), Edit(7, 8)])
    assert runs_of(result.position_map) == (RowRun(0, 0, 2), RowRun(4, 3, 3), RowRun(8, 6, 2))


def test_an_answer_round_trips_and_rows_form_columns() -> None:
    answer = Answer(3, 1, 7, "missing_source", 2, "gone")
    params = json.loads(json.dumps({ANSWER_KEY: answer.to_payload()}))
    assert Answer.from_params(params) == answer
    assert Answer.from_params({"other": 1}) is None
    moves = RowMoves.of([(1, 2, 3, 4, 5), (6, 7, 8, 9, -1)])
    assert (moves.src_blocks, moves.shifts, len(moves)) == ((1, 6), (5, -1), 2)
    assert len(RowMoves.of([])) == 0
