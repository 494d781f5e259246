"""`leyline eval compose`: the synthesized skills, the no-rotation control's construction,
and the fast mode end to end on SmolLM2 (its figures checked against themselves and the
reference against a plain transformers forward)."""

from __future__ import annotations

import dataclasses
import hashlib
import re
import statistics
from typing import Any

import pytest
import torch

from leyline.engine.edits.skills import compile_skill
from leyline.engine.engine import Engine
from leyline.engine.models import build_tiny_mla, load_model
from leyline.engine.rope import delta_rotate
from leyline.engine.session import SessionCache
from leyline.evals.compose.anchor import anchor_text
from leyline.evals.compose.arms import attention_mode, timed_compose, unrotated
from leyline.evals.compose.cases import (
    CONTEXT_RESERVE,
    answer_token,
    fit_case,
    make_items,
    make_skill,
)
from leyline.evals.compose.contexts import _SYSTEMS, _TURNS
from leyline.evals.compose.run import ComposeOptions, skill_budget
from leyline.evals.compose.texts import KINDS
from tests.meta.fresh_python import eval_cli_loads

from .fast_run import fast_run

FILES = ("report.json", "report.md", "ttft.png", "kl_by_k.png")


def _words(text: str) -> list[int]:
    """A stand-in tokenizer: one stable id per word, punctuation mark or newline."""
    return [
        int.from_bytes(hashlib.blake2b(w.encode(), digest_size=2).digest(), "little")
        for w in re.findall(r"\w+|[^\w\s]|\n", text)
    ]


def test_skills_are_seeded_fit_their_length_and_ask_about_their_units() -> None:
    for kind in KINDS:
        short, long = (make_skill(kind, n, 10_000, _words, 0) for n in (300, 1200))
        assert short == make_skill(kind, 300, 10_000, _words, 0)
        assert short.tokens != make_skill(kind, 300, 10_000, _words, 1).tokens
        assert len(short.tokens) <= 300 and len(long.tokens) <= 1200 and short.units < long.units
        assert len(make_skill(kind, 1200, 500, _words, 0).tokens) <= 500  # the context cap
        items = make_items(long, 3, _words, 0)
        assert [i.unit for i in items] == sorted({i.unit for i in items})  # spread, distinct
        assert all(i.unit < long.units and i.answer_token is not None for i in items)
        # Item i has the same prefix at every length; different items differ.
        assert items[0].prefix == make_items(short, 3, _words, 0)[0].prefix != items[1].prefix
    assert answer_token(_words, "go to the", " Falcon") == _words("Falcon")[0]


def test_a_deeper_prefix_keeps_the_recent_conversation_and_the_question() -> None:
    """``--prefix-tokens``: earlier exchanges grow each prefix to the depth asked for; the
    system prompt, the last exchanges, the question and the answer stay the item's own."""
    skill = make_skill("passage", 400, 10_000, _words, 0)
    shallow = make_items(skill, 3, _words, 0)
    deep = make_items(skill, 3, _words, 0, prefix_tokens=1500)
    for a, b in zip(shallow, deep, strict=True):
        assert len(a.prefix) < 1500 <= len(b.prefix) < 1500 + 200  # at most one exchange more
        assert (a.question, a.answer, a.answer_token, a.unit) == (
            b.question, b.answer, b.answer_token, b.unit,
        )  # fmt: skip
        start = tuple(_words("<|im_start|>"))
        turns = [i for i in range(len(a.prefix)) if a.prefix[i : i + len(start)] == start]
        system, tail = a.prefix[: turns[1]], len(a.prefix) - turns[1]  # then the exchanges
        assert b.prefix[: turns[1]] == system and b.prefix[-tail:] == a.prefix[-tail:]
    assert make_items(skill, 3, _words, 0, prefix_tokens=0) == shallow


def test_a_prefix_that_leaves_no_room_for_the_skill_is_refused() -> None:
    options = ComposeOptions("smollm2", ("policy",), (512, 1024), (16,), 16, 1, 0, None)
    assert skill_budget(8192, options) == 8192 - CONTEXT_RESERVE
    deep = dataclasses.replace(options, prefix_tokens=7500)
    with pytest.raises(ValueError, match="--prefix-tokens 7500 leaves no room for a 512-token"):
        skill_budget(8192, deep)
    assert skill_budget(None, deep) > 1 << 29  # no context limit: no cap


def test_a_skill_capped_by_the_context_leaves_room_for_every_item() -> None:
    """``--full``'s 8k on an 8,192-position model: the skill is shortened by whole units
    until each item's prefix + skill + question fits, however long its prefix."""
    for kind in KINDS:
        for depth in (0, 300):
            whole = make_skill(kind, 1200, 700, _words, 0)
            case, items = fit_case(
                kind, 1200, _words, 0, 3, max_session_tokens=700, prefix_tokens=depth
            )
            assert case.units < whole.units and case.tokens[:20] == whole.tokens[:20]
            assert all(len(i.prefix) + len(case.tokens) + len(i.question) <= 700 for i in items)
            assert [i.prefix for i in items] == [
                i.prefix for i in make_items(case, 3, _words, 0, depth)
            ]
        with pytest.raises(ValueError, match=r"one-unit .* takes .* positions; the model has 60"):
            fit_case(kind, 1200, _words, 0, 3, max_session_tokens=60)


@torch.inference_mode()
def test_the_control_lands_unrotated_and_compose_rotates() -> None:
    """Tiny MLA (RANDOM WEIGHTS): composed at ``at`` with K = 0, the control's block holds
    the skill's compiled keys as they are; the real compose holds them rotated by ``at``."""
    engine = Engine(build_tiny_mla("v3"))
    layout, rope = engine.layout, engine.rope
    assert layout is not None and rope is not None
    gen = torch.Generator().manual_seed(0)
    prefix, block = (torch.randint(3, engine.vocab_size, (n,), generator=gen) for n in (20, 12))
    skill = compile_skill(engine, block.tolist(), skill_id="s", tenant="t")
    at = len(prefix)
    for control in (False, True):
        session = SessionCache(engine)
        session.prefill(prefix.tolist())
        session.compose(unrotated(engine, skill, at) if control else skill, at, seam_tokens=0)
        for got, compiled in zip(session.kv, skill.kv, strict=True):
            keys, want = got[layout.slot][..., at : at + len(skill), :], compiled[layout.slot]
            if not control:
                want = delta_rotate(want, at, rope.inv_freq, layout.pairing, offset=layout.offset)
            assert (keys - want).abs().max() <= 1e-5 * want.abs().max()
            assert (keys - compiled[layout.slot]).abs().max() > 1e-2 or control
            other = 1 - layout.slot  # position-free: copied bitwise either way
            assert torch.equal(got[other][..., at : at + len(skill), :], compiled[other])


@torch.inference_mode()
def test_question_aware_recompute_of_the_whole_block_is_a_full_prefill() -> None:
    """Tiny MLA (RANDOM WEIGHTS): the ask arm (the server's attention mode, ranked by the
    question that follows the block) recomputing every copied token equals a prefill of
    prefix + skill + question; a share of them differs from the seam-only compose; the
    model's attention implementation is left as it was."""
    engine = Engine(build_tiny_mla("v2"))
    kernel = engine.model.config._attn_implementation
    gen = torch.Generator().manual_seed(1)
    prefix, block, question = (
        torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist() for n in (20, 14, 6)
    )
    skill = compile_skill(engine, block, skill_id="s", tenant="t")
    session = SessionCache(engine)
    session.prefill(prefix)
    _, full = engine.forward((), prefix + block + question)

    def gap(logits: torch.Tensor) -> float:
        a, b = torch.log_softmax(full.double(), -1), torch.log_softmax(logits.double(), -1)
        return float((a - b).abs().max())

    everything, _, path = timed_compose(session, skill, 2, question, attention_mode(1.0))
    assert path == "splice" and gap(everything) <= 1e-4
    part, _, _ = timed_compose(session, skill, 2, question, attention_mode(0.3))
    seam_only, _, _ = timed_compose(session, skill, 2, question)
    assert abs(gap(part) - gap(seam_only)) > 1e-3
    assert engine.model.config._attn_implementation == kernel


def test_cli_module_does_not_import_torch() -> None:
    assert "torch" not in eval_cli_loads("compose")


@pytest.fixture(scope="module")
def fast_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return fast_run("compose", tmp_path_factory.mktemp("compose"), FILES)


def _kl(records: list[dict[str, Any]], arm: str) -> float:
    return statistics.fmean(r["arms"][arm]["kl"] for r in records)


@pytest.mark.slow
@pytest.mark.model
def test_fast_run(fast_report: dict[str, Any]) -> None:
    config, summary, records = fast_report["config"], fast_report["summary"], fast_report["records"]
    assert config["fast"] and config["kinds"] == "policy,tools" and config["seams"] == "0,4,16"
    assert config["recompute_ratios"] == config["ask_ratios"] == "0.15"
    assert not config["random_weights"] and len(records) == 4
    assert summary["all_finite"] and summary["fallbacks"] == 0
    for r in records:
        assert all(a["finite"] for a in r["arms"].values())
        assert set(r["paths"].values()) == {"splice"}
        assert r["arms"]["full"]["kl"] == 0 and r["answer_token"] is not None
    for kind in ("policy", "tools"):
        mine = [r for r in records if r["kind"] == kind]
        (cell,) = [c for c in summary["cells"] if c["kind"] == kind]
        assert cell["items"] == len(mine) == 2
        assert abs(cell["arms"]["compose_k16"]["kl"]["mean"] - _kl(mine, "compose_k16")) < 1e-12
        # The rotation and the seam each matter, and the skill matters far more than either.
        assert _kl(mine, "norot_k16") > 2 * _kl(mine, "compose_k16")
        assert _kl(mine, "compose_k16") < _kl(mine, "compose_k0")
        assert _kl(mine, "no_skill") > 10 * _kl(mine, "compose_k16")
        # Selective recompute ran (as a splice: above) and stays near the seam-only compose.
        assert _kl(mine, "compose_k16_dev15") < 2 * _kl(mine, "compose_k16")
        p = {
            a: statistics.fmean(r["arms"][a]["p_answer"] for r in mine)
            for a in ("full", "no_skill")
        }
        assert p["full"] > 100 * p["no_skill"]
    tools = [r for r in records if r["kind"] == "tools"]
    # Recomputing what the question reads recovers the tool spec (measured: KL / 20).
    assert _kl(tools, "compose_k16_ask15") < 0.25 * _kl(tools, "compose_k16")
    p_rows = {row["kind"]: row for row in summary["p_answer"]}
    assert set(p_rows) == {"policy", "tools"} and "compose_k16_dev15" in p_rows["tools"]["arms"]
    (row,) = summary["ttft"]
    assert row["repeats"] == 4 and row["compose"]["0"]["cached"] < row["full"]["cached"]
    assert set(row["recompute"]) == {
        "compose_k16_dev15",
        "compose_k16_ask15",
        "anchored_k16",
        "anchored_k16_ask15",
    }
    assert [t["met"] for t in summary["targets"]][-1] is None  # no 4k in --fast
    # The anchored compile (default: the chat template's header before a user message).
    assert config["anchor"].startswith("<|im_start|>system\n") and config["anchor_tokens"] > 5
    assert all(m["anchored_compile_seconds"] > 0 for m in summary["memory"])
    first = summary["anchored_targets"][0]["target"]
    assert first == "policy: mean KL at anchored_k16, worst length"
    judged = summary["recompute_targets"]
    assert set(judged) == {"compose_k16_dev15", "compose_k16_ask15"}
    assert judged["compose_k16_ask15"][0]["target"].startswith("policy: mean KL at compose_k16")
    for kind in ("policy", "tools"):
        mine = [r for r in records if r["kind"] == kind]
        assert _kl(mine, "anchored_k16") < _kl(mine, "compose_k0")
    # Measured: the tool spec's KL halves (0.146 -> 0.074) when the block is compiled after
    # a sequence start instead of being one.
    assert _kl(tools, "anchored_k16") < 0.75 * _kl(tools, "compose_k16")
    assert {m["nbytes"] for m in summary["memory"]} and all(
        m["nbytes"] == m["tokens"] * 30 * 2 * 3 * 64 * 4 for m in summary["memory"]
    )  # SmolLM2: 30 layers x (K, V) x 3 KV heads x 64 dims x fp32


@pytest.mark.slow
@pytest.mark.model
@torch.inference_mode()
def test_the_reference_is_a_plain_forward(fast_report: dict[str, Any]) -> None:
    """Record 0's ``full`` arm recomputed by transformers alone on prefix + skill + question."""
    loaded = load_model("smollm2")

    def encode(text: str) -> list[int]:
        return list(loaded.tokenizer.encode(text, add_special_tokens=False))

    skill = make_skill("policy", 256, 8192, encode, 0)
    item = make_items(skill, 2, encode, 0)[0]
    record = fast_report["records"][0]
    assert (record["kind"], record["index"], record["skill_tokens"]) == (
        "policy",
        0,
        len(skill.tokens),
    )
    ids = torch.tensor([list(item.prefix + skill.tokens + item.question)])
    logits = loaded.model(input_ids=ids, use_cache=False).logits[0, -1].double()
    p = float(torch.softmax(logits, -1)[record["answer_token"]])
    assert abs(p - record["arms"]["full"]["p_answer"]) < 1e-4
    assert (int(logits.argmax()) == record["answer_token"]) == record["arms"]["full"][
        "answer_is_argmax"
    ]


class _Template:
    """A stand-in chat template: ``<s>[user] {content} [/user]``, or one that rewrites it."""

    def __init__(self, rewrite: bool = False) -> None:
        self.rewrite = rewrite

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        def render(message: dict[str, str]) -> str:
            role, content = message["role"], message["content"]
            return f"[{role}] " + (content[::-1] if self.rewrite else content) + f" [/{role}]"

        return "<s>" + "".join(render(m) for m in messages)


def test_the_default_anchor_is_what_the_template_puts_before_the_content() -> None:
    assert anchor_text("template", _Template()) == "<s>[user] "
    assert anchor_text("none", _Template()) == anchor_text(None, _Template()) == ""
    assert anchor_text("Context: ", _Template()) == "Context: "
    with pytest.raises(ValueError, match="verbatim"):
        anchor_text("template", _Template(rewrite=True))


def test_the_conversation_anchor_is_small_talk_before_a_user_message() -> None:
    """``--anchor conversation``: a system prompt and two exchanges rendered by the template,
    cut where the next user message's content would start; none of it is the eval's text."""
    text = anchor_text("conversation", _Template())
    assert text.startswith("<s>[system] ") and text.endswith("[/assistant][user] ")
    assert text.count("[user]") == 3 and text.count("[assistant]") == 2
    assert "basil" in text and "ACME" not in text
    contexts = " ".join(_SYSTEMS + tuple(line for turn in _TURNS for line in turn))
    assert not any(sentence in contexts for sentence in text.split(". "))
    with pytest.raises(ValueError, match="verbatim"):
        anchor_text("conversation", _Template(rewrite=True))
