"""Config strings, dicts and JSON; the registry and its entry-point group."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest

from leyline.policies import (
    Chain,
    PolicyConfigError,
    PolicyRegistry,
    StaleToolOutputs,
    TokenBudget,
    TruncateOldToolOutputs,
    UnknownPolicyError,
    When,
    default_registry,
    parse_policy,
    run_policy,
)
from leyline.policies import registry as registry_module
from leyline.protocol import Mode

from .plugin_example import ShoutingStub
from .transcripts import episode


def test_string_dict_json_and_object_forms_are_one_policy() -> None:
    expected = TruncateOldToolOutputs(keep_last=3, mode=Mode.forget)
    assert parse_policy("truncate:keep_last=3,mode=forget") == expected
    assert parse_policy(" truncate : keep_last = 3 , mode = forget ") == expected
    assert parse_policy({"type": "truncate", "keep_last": 3, "mode": "forget"}) == expected
    assert parse_policy('{"type": "truncate", "keep_last": 3, "mode": "forget"}') == expected
    assert parse_policy(expected) is expected
    assert parse_policy(expected.model_dump(mode="json")) == expected
    spliced = parse_policy("truncate:mode=splice")
    assert isinstance(spliced, TruncateOldToolOutputs) and spliced.mode is Mode.amortize


def test_defaults_pipelines_and_nesting() -> None:
    assert parse_policy("truncate") == TruncateOldToolOutputs()
    chain = parse_policy("stale | truncate:keep_last=1 | budget:max_tokens=9,target_tokens=5")
    assert isinstance(chain, Chain)
    assert [type(p) for p in chain.policies] == [
        StaleToolOutputs,
        TruncateOldToolOutputs,
        TokenBudget,
    ]
    when = parse_policy("when:min_turns=3,policy=(stale | truncate:keep_last=1,mode=forget)")
    assert isinstance(when, When) and isinstance(when.policy, Chain)
    dumped = when.model_dump(mode="json")
    assert dumped["policy"]["policies"][1]["mode"] == "forget"  # nested policies serialise
    assert parse_policy(dumped) == when


def test_json_values_and_bracketed_text() -> None:
    policy = parse_policy('stale:view_tools={"cat": "file", "less": "file"},superseded=false')
    assert isinstance(policy, StaleToolOutputs)
    assert policy.view_tools == {"cat": "file", "less": "file"} and policy.superseded is False
    truncate = parse_policy('truncate:exclude_tools=["plan"],stub=[gone, {tool}]')
    assert isinstance(truncate, TruncateOldToolOutputs)
    assert truncate.exclude_tools == ("plan",) and truncate.stub == "[gone, {tool}]"


@pytest.mark.parametrize(
    ("config", "problem"),
    [
        ("", "empty config"),
        ("   ", "empty config"),
        ("stale |", "empty policy between '\\|'"),
        (":keep_last=2", "missing policy name"),
        ("trunc ate", "'trunc ate' is not a policy name"),
        ("truncate:", "nothing after ':'"),
        ("truncate:keep_last", "not of the form key=value"),
        ("truncate:keep_last=1,keep_last=2", "'keep_last' is given twice"),
        ("truncate:type=stale", "'type' is given by the name"),
        ("truncate:keep_lats=2", "unknown option 'keep_lats' \\(options: keep_last, stub"),
        ("truncate:keep_last=two", "keep_last: Input should be a valid integer"),
        ("truncate:keep_last=-1", "keep_last: Input should be greater than or equal to 0"),
        ("truncate:stub={nope}", "stub template field \\{nope\\} is unknown"),
        ("truncate:stub=", "stub template must not be empty"),
        ("truncate:mode=sometimes", "mode: Input should be 'amortize' or 'forget'"),
        ('truncate:stub="unterminated', "unterminated quote"),
        ("truncate:stub=a]", "unbalanced ']'"),
        ("when:min_turns=2", "option 'policy' is required"),
        ("when:policy=stale", "give at least one condition"),
        ("chain", "option 'policies' is required"),
        ('{"type": "truncate", ', "invalid JSON"),
        ("[1, 2]", "not a policy name"),
        ({"keep_last": 2}, "needs a 'type' name"),
    ],
)
def test_malformed_configs_name_the_problem(config: str, problem: str) -> None:
    with pytest.raises(PolicyConfigError, match=problem):
        parse_policy(config)


def test_unknown_policy_names_the_known_ones() -> None:
    with pytest.raises(UnknownPolicyError) as info:
        parse_policy("truncat:keep_last=2")
    assert info.value.name == "truncat"
    assert {"truncate", "stale", "failed", "budget", "errata", "chain", "when"} <= set(
        info.value.known
    )
    with pytest.raises(PolicyConfigError, match="no policy named 'nope'"):
        parse_policy("when:min_turns=1,policy=nope")


def _fake_entry_points(monkeypatch: pytest.MonkeyPatch, *points: tuple[str, str]) -> None:
    eps = [EntryPoint(name, value, registry_module.ENTRY_POINT_GROUP) for name, value in points]

    def entry_points(*, group: str) -> list[EntryPoint]:
        return [ep for ep in eps if ep.group == group]

    monkeypatch.setattr(registry_module, "entry_points", entry_points)


def test_third_party_policies_join_via_entry_points(monkeypatch: pytest.MonkeyPatch) -> None:
    _fake_entry_points(
        monkeypatch,
        ("shout", "tests.policies.plugin_example:ShoutingStub"),
        ("broken", "tests.policies.no_such_module:Policy"),
        ("not-a-policy", "tests.policies.plugin_example:__doc__"),
        ("misnamed", "tests.policies.plugin_example:Misnamed"),
    )
    fresh = PolicyRegistry()
    assert {"shout", "broken", "truncate"} <= set(fresh.names())
    policy = fresh.parse("stale | shout:word=CUT")
    assert isinstance(policy, Chain) and policy.policies[1] == ShoutingStub(word="CUT")
    edits = run_policy(fresh.parse("shout"), episode(2))
    assert len(edits) == 2
    with pytest.raises(PolicyConfigError, match=r"entry point .*no_such_module.* failed to load"):
        fresh.get("broken")
    with pytest.raises(PolicyConfigError, match="must be a Policy subclass whose type is"):
        fresh.get("not-a-policy")
    with pytest.raises(PolicyConfigError, match="whose type is 'misnamed'"):
        fresh.get("misnamed")


def test_in_process_registration_and_name_clashes() -> None:
    fresh = PolicyRegistry(group=None)
    fresh.register(ShoutingStub)
    assert fresh.parse("shout:word=X") == ShoutingStub(word="X")
    with pytest.raises(PolicyConfigError, match="already taken"):
        fresh.register(type("Other", (ShoutingStub,), {"__module__": __name__}))
    with pytest.raises(PolicyConfigError, match="only subclasses of Policy"):
        fresh.register(dict)  # type: ignore[arg-type]
    assert "shout" not in default_registry.names()  # the process-wide registry was not touched
