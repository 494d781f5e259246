"""TokenBudget: hysteresis (edit only over max, then down to target in one batch)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from leyline.policies import (
    Message,
    PolicyConfigError,
    PolicyEdit,
    ReplaceContent,
    TokenBudget,
    apply_to_messages,
    parse_policy,
    run_policy,
)

from .transcripts import COUNTER, episode, total


def run(policy: TokenBudget, messages: Sequence[Message]) -> list[PolicyEdit]:
    return run_policy(policy, messages, counter=COUNTER)


def test_under_the_maximum_nothing_happens() -> None:
    messages = episode(4)
    assert run(TokenBudget(max_tokens=total(messages), target_tokens=10), messages) == []


def test_over_the_maximum_one_batch_brings_it_down_to_target() -> None:
    messages = episode(8)
    size = total(messages)
    policy = TokenBudget(max_tokens=size - 1, target_tokens=size // 2)
    edits = run(policy, messages)
    after = apply_to_messages(messages, edits).messages
    assert total(after) <= size // 2
    # Oldest first, and the last tool turn is protected (keep_last=1).
    stubbed = [e.message for e in edits if isinstance(e, ReplaceContent)]
    assert stubbed == sorted(stubbed) and stubbed[0] == 3 and 17 not in stubbed
    # Only as many as needed: one fewer would not have reached the target.
    assert total(apply_to_messages(messages, edits[:-1]).messages) > size // 2


def test_hysteresis_no_edit_until_the_maximum_is_crossed_again() -> None:
    full = episode(20)
    full[2:] = [{**m, "content": None} if m["role"] == "assistant" else m for m in full[2:]]
    policy = TokenBudget(max_tokens=total(full[:14]), target_tokens=total(full[:8]))
    current: list[Message] = list(full[:4])
    fired = []
    for turn in range(4, len(full), 2):
        current = [*current, *full[turn : turn + 2]]
        edits = run(policy, current)
        assert bool(edits) == (total(current) > policy.max_tokens)
        if edits:
            fired.append(turn)
            current = list(apply_to_messages(current, edits).messages)
            assert total(current) <= policy.target_tokens
    # Over 16 more turns the budget fired in a few batches, not on every turn.
    assert 2 <= len(fired) <= 4, fired


def test_min_saving_skips_outputs_not_worth_a_splice() -> None:
    messages = episode(4)
    size = total(messages)
    policy = TokenBudget(max_tokens=size - 1, target_tokens=10, min_saving=10_000)
    assert run(policy, messages) == []


def test_pinned_stubbed_and_recent_outputs_are_never_candidates() -> None:
    messages = episode(4)
    policy = TokenBudget(max_tokens=10, target_tokens=5, keep_last=2)
    edits = run_policy(policy, messages, counter=COUNTER, pinned=[3])
    assert [e.message for e in edits if isinstance(e, ReplaceContent)] == [5]
    after = apply_to_messages(messages, edits).messages
    assert run_policy(policy, after, counter=COUNTER, pinned=[3]) == []


def test_target_must_be_below_max() -> None:
    with pytest.raises(PolicyConfigError, match=r"target_tokens .* must be below max_tokens"):
        parse_policy("budget:max_tokens=100,target_tokens=100")
    with pytest.raises(PolicyConfigError, match="max_tokens: Input should be greater than 0"):
        parse_policy("budget:max_tokens=-5,target_tokens=1")
