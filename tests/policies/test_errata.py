"""FieldErrata: a field changed inside the cached prefix becomes an appended note."""

from __future__ import annotations

from leyline.policies import (
    AppendErratum,
    FieldErrata,
    KeepServed,
    PolicyEdit,
    apply_to_messages,
    run_policy,
)

from .transcripts import Msg, assistant, system, user

STATE = "You are a support agent.\norder_id: 42\norder_status: pending\nBe brief."


def served() -> list[Msg]:
    return [system(STATE), user("Where is my order?"), assistant(text="Checking.")]


def with_status(status: str, extra: str = "") -> list[Msg]:
    messages = served()
    messages[0] = system(STATE.replace("pending", status) + extra)
    return messages


def persistent(edits: list[PolicyEdit]) -> list[PolicyEdit]:
    """What a middleware keeps across turns (KeepServed applies to one request only)."""
    return [e for e in edits if not isinstance(e, KeepServed)]


def test_a_changed_field_is_kept_as_served_and_noted_at_the_end() -> None:
    edits = run_policy(FieldErrata(), with_status("refunded"), served=served())
    assert edits == [
        KeepServed(0, STATE, reason="keep the cached prefix"),
        AppendErratum(
            "[STATE UPDATE] order_status -> refunded; overrides the earlier value.", corrects=0
        ),
    ]
    sent = apply_to_messages(with_status("refunded"), edits).messages
    assert sent[:3] == tuple(served())  # the cached prefix is byte-identical
    assert sent[3] == {"role": "user", "content": edits[1].text}  # type: ignore[union-attr]


def test_the_note_is_not_repeated_next_turn() -> None:
    agent = with_status("refunded")
    edits = run_policy(FieldErrata(), agent, served=served())
    next_served = apply_to_messages(agent, edits).messages
    agent_view = apply_to_messages(agent, persistent(edits)).messages
    again = run_policy(FieldErrata(), agent_view, served=next_served)
    assert again == [KeepServed(0, STATE, reason="keep the cached prefix")]


def test_a_field_set_back_to_its_served_value_gets_a_note_too() -> None:
    agent = with_status("refunded")
    edits = run_policy(FieldErrata(), agent, served=served())
    next_served = apply_to_messages(agent, edits).messages
    reverted = apply_to_messages(served(), persistent(edits)).messages
    notes = run_policy(FieldErrata(), reverted, served=next_served)
    assert [e.text for e in notes if isinstance(e, AppendErratum)] == [
        "[STATE UPDATE] order_status -> pending; overrides the earlier value."
    ]


def test_changes_that_are_not_field_changes_are_left_to_a_splice() -> None:
    assert run_policy(FieldErrata(), with_status("pending", "\nNew rule."), served=served()) == []
    reworded = served()
    reworded[0] = system(STATE.replace("Be brief.", "Be very brief."))
    assert run_policy(FieldErrata(fields=("order_status",)), reworded, served=served()) == []


def test_nothing_cached_nothing_changed_or_pinned_means_no_edit() -> None:
    assert run_policy(FieldErrata(), with_status("refunded")) == []
    assert run_policy(FieldErrata(), served(), served=served()) == []
    assert run_policy(FieldErrata(), with_status("refunded"), served=served(), pinned=[0]) == []


def test_appended_messages_do_not_confuse_the_alignment() -> None:
    agent = [*with_status("shipped"), user("And now?")]
    edits = run_policy(FieldErrata(), agent, served=served())
    sent = apply_to_messages(agent, edits).messages
    assert sent[:3] == tuple(served()) and sent[3] == user("And now?")
    assert "order_status -> shipped" in str(sent[4]["content"])
