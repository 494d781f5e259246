"""The engine on the real SmolLM2-135M-Instruct (fp32): splice fidelity, forget, generation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from leyline.core.turns import SamplingParams
from leyline.engine.edits.run_executor import execute_edit, slice_kv
from leyline.engine.engine import Engine
from leyline.engine.kv.layouts import CacheLayout
from leyline.engine.rope import RopeSpec
from leyline.engine.session import SessionCache
from leyline.protocol.algebra import Edit, apply_edits
from leyline.protocol.directives import ErratumDirective, Mode, SpliceDirective
from leyline.protocol.envelope import Path
from leyline.protocol.spans import TokenSpan

from ._helpers import kl, rel_err, snapshot

pytestmark = [pytest.mark.slow, pytest.mark.model]

PREFIX = (
    "<|im_start|>user\nThe test test_divide fails in calculator.py. Read the file, find the "
    "bug and tell me which function is wrong and why.<|im_end|>\n<|im_start|>assistant\n"
    "I will read the file first.<|im_end|>\n<|im_start|>tool\n"
)
SPAN = "".join(
    f'def op_{i}(a, b):\n    """Operation number {i} of the calculator."""\n'
    f"    return a {'+-*'[i % 3]} b\n\n"
    for i in range(14)
)
STUB = "[tool output removed: 14 helper functions]"
SUFFIX = (
    "def divide(a, b):\n    return a * b\n<|im_end|>\n<|im_start|>assistant\n"
    "The helper functions look fine. The function divide multiplies instead of dividing: it "
    "returns a * b where it should return a / b, and it never checks for b == 0, so "
    "test_divide gets 12 instead of 3. The fix is to change the operator in divide and to "
    "raise ZeroDivisionError when b is 0. In short, the wrong function is"
)


@pytest.fixture(scope="module")
def doc(smollm2_engine: Engine) -> tuple[list[int], int, int, tuple[int, ...]]:
    """(tokens, span start, span end, stub tokens): ~100 / ~300 / ~100 tokens."""
    e = smollm2_engine
    prefix, span, suffix = e.encode(PREFIX), e.encode(SPAN), e.encode(SUFFIX)
    tokens = list(prefix + span + suffix)
    return tokens, len(prefix), len(prefix) + len(span), e.encode(STUB)


def _last_logits(engine: Engine, kv, tokens) -> torch.Tensor:
    """Next-token logits after ``tokens`` given their KV (the last token run again)."""
    return engine.forward(slice_kv(kv, 0, len(tokens) - 1), tokens[-1:])[1]


def test_splice_is_far_closer_to_reprefill_than_no_rotation_or_wrong_layout(
    smollm2_engine: Engine, doc
) -> None:
    e = smollm2_engine
    tokens, start, end, stub = doc
    assert end - start > 250 and len(tokens) - end > 80
    session = SessionCache(e)
    session.prefill(tokens)
    kv = session.kv
    result = apply_edits(tokens, [Edit(start, end, stub, Mode.amortize)])
    reference = e.forward((), result.tokens)[1]
    report = session.apply_edits([Edit(start, end, stub, Mode.amortize)])
    assert report.path is Path.splice and report.prefilled_tokens == len(stub)
    right = kl(reference, session.next_token_logits())
    assert e.rope is not None and e.layout is not None
    no_rotation = RopeSpec(e.rope.rope_type, torch.zeros_like(e.rope.inv_freq), 1.0)
    wrong_layout = CacheLayout("gqa", 0, 0, 64, "interleaved")
    arms = {"none": (e.layout, no_rotation), "wrong": (wrong_layout, e.rope)}
    other = {}
    for name, (layout, rope) in arms.items():
        out = execute_edit(e.forwards, layout, rope, kv, result, old_exact_length=len(tokens))
        other[name] = kl(reference, _last_logits(e, out.kv, result.tokens))
    # Measured: right 0.07, no rotation 1.03, wrong layout 3.7 (nats).
    assert right < 0.25 and right < other["none"] / 5 and right < other["wrong"] / 5, (right, other)


def test_downstream_keys_equal_keys_recomputed_at_the_new_positions(
    smollm2_engine: Engine, doc
) -> None:
    """Pre-rope keys captured during prefill, rotated by transformers' own RoPE at the new
    positions, against the spliced cache; values bitwise."""
    e = smollm2_engine
    tokens, start, end, stub = doc
    captured: dict[int, list[torch.Tensor]] = {}  # per layer, one entry per prefill chunk
    hooks = [
        layer.self_attn.k_proj.register_forward_hook(
            lambda _m, _i, out, i=i: captured.setdefault(i, []).append(out.detach().clone())
        )
        for i, layer in enumerate(e.model.model.layers)
    ]
    try:
        session = SessionCache(e)
        session.prefill(tokens)
    finally:
        for h in hooks:
            h.remove()
    old = snapshot(session.kv)
    session.apply_edits([Edit(start, end, stub, Mode.amortize)])
    delta = len(stub) - (end - start)
    n = len(tokens)
    new_pos = torch.arange(end + delta, n + delta).unsqueeze(0)
    for i, (keys, values) in enumerate(session.kv):
        pre = torch.cat(captured[i], dim=1).view(1, n, -1, 64).transpose(1, 2)[..., end:, :]
        cos, sin = e.model.model.rotary_emb(pre, new_pos)
        want = apply_rotary_pos_emb(pre, pre, cos, sin)[1]
        assert rel_err(keys[..., end + delta :, :], want) <= 1e-5, i
        assert torch.equal(values[..., end + delta :, :], old[i][1][..., end:, :])


def test_forget_equals_a_fresh_prefill(smollm2_engine: Engine, doc) -> None:
    e = smollm2_engine
    tokens, start, end, stub = doc
    session = SessionCache(e)
    session.prefill(tokens)
    report = session.apply_edits([Edit(start, end, stub, Mode.forget)])
    assert report.path is Path.reprefill and report.reused_tokens == start
    fresh_kv, fresh_logits = e.forward((), session.tokens)
    assert rel_err(session.next_token_logits(), fresh_logits) <= 1e-5
    for got, want in zip(session.kv, fresh_kv, strict=True):
        assert rel_err(got[0], want[0]) <= 1e-5 and rel_err(got[1], want[1]) <= 1e-5


def test_splicing_a_span_with_itself_keeps_full_context_logits(smollm2_engine: Engine, doc):
    e = smollm2_engine
    tokens, start, end, _ = doc
    session = SessionCache(e)
    session.prefill(tokens)
    full = session.next_token_logits()
    session.apply_edits([Edit(start, end, tuple(tokens[start:end]), Mode.amortize)])
    assert rel_err(session.next_token_logits(), full) <= 1e-6


def test_greedy_answer_and_seeded_sampling(smollm2_engine: Engine) -> None:
    e = smollm2_engine
    assert e.tokenizer is not None
    prompt = e.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    session = SessionCache(e)
    session.prefill(e.encode(prompt))
    rev = session.revision
    out = session.generate(SamplingParams(max_new_tokens=24))
    assert "Paris" in out.text and out.finish_reason == "stop" and out.revision == rev + 1
    assert session.tokens[-len(out.tokens) :] == out.tokens
    runs = []
    for _ in range(2):
        s = SessionCache(e)
        s.prefill(e.encode(prompt))
        runs.append(
            s.generate(
                SamplingParams(max_new_tokens=8, temperature=0.8, top_p=0.9, top_k=50, seed=7)
            ).tokens
        )
    assert runs[0] == runs[1]
    short = SessionCache(e)
    short.prefill(e.encode(prompt))
    cut = short.generate(SamplingParams(max_new_tokens=3))
    assert cut.finish_reason == "length" and len(cut.tokens) == 3
    again = SessionCache(e)
    again.prefill(e.encode(prompt))
    stopped = again.generate(SamplingParams(max_new_tokens=24, stop=(" of France",)))
    assert stopped.finish_reason == "stop" and stopped.text == "The capital"


def test_text_directives_are_tokenized_by_the_engine(smollm2_engine: Engine, doc) -> None:
    e = smollm2_engine
    tokens, start, end, stub = doc
    session = SessionCache(e)
    session.prefill(tokens)
    report = session.apply_directives(
        [
            SpliceDirective(span=TokenSpan(start=start, end=end), replacement=STUB),
            ErratumDirective.for_field("bug", "divide uses *"),
        ],
        base_revision=session.revision,
    )
    assert report.path is Path.splice and session.tokens[start : start + len(stub)] == stub
    assert e.decode(session.tokens[-12:]).endswith("overrides the earlier value.\n")
