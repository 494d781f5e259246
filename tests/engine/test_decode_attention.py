"""The single-query attention path against torch's SDPA (the independent reference)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.nn.functional as F

from leyline.engine.decode_attention import (
    MIN_KEYS,
    matmul_attention,
    single_query_attention,
    takes_single_query,
)

from ._kernels import benchmark_lines


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "value_dim", "n"),
    [(9, 3, 64, 64, 4096), (8, 8, 24, 16, 300), (4, 1, 32, 32, 1), (6, 2, 8, 8, 77)],
)
def test_equals_sdpa_on_views_of_a_larger_buffer(
    heads: int, kv_heads: int, dim: int, value_dim: int, n: int
) -> None:
    g = torch.Generator().manual_seed(n)
    capacity = n + 13  # the cache is a view of the first n positions of a bigger buffer
    keys = torch.randn(1, kv_heads, capacity, dim, generator=g)[:, :, :n]
    values = torch.randn(1, kv_heads, capacity, value_dim, generator=g)[:, :, :n]
    query = torch.randn(1, 1, heads, dim, generator=g).transpose(1, 2)  # as the model passes it
    for scale, fn in itertools.product((None, 0.3), (single_query_attention, matmul_attention)):
        got = fn(query, keys, values, scale)
        want = F.scaled_dot_product_attention(
            query, keys, values, scale=scale, enable_gqa=heads != kv_heads
        )
        assert got.shape == want.shape == (1, heads, 1, value_dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert (got - want).abs().max() < 1e-5


def test_only_one_query_of_one_row_takes_the_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the compiled kernel (``test_attention_kernel`` covers it): fp32 past
    ``MIN_KEYS`` only, one query of one row, heads a multiple of kv heads."""
    from leyline.engine.cpu import attention_kernel

    monkeypatch.setattr(attention_kernel, "load", lambda: None)
    k = torch.zeros(1, 3, MIN_KEYS, 8)

    def takes(query: torch.Tensor, keys: torch.Tensor) -> bool:
        return takes_single_query(query, keys, keys)

    assert takes(torch.zeros(1, 9, 1, 8), k)
    assert not takes(torch.zeros(1, 9, 1, 8), k[:, :, :-1])  # a short cache
    assert not takes(torch.zeros(1, 9, 2, 8), k)  # a run of queries
    assert not takes(torch.zeros(2, 9, 1, 8), torch.zeros(2, 3, MIN_KEYS, 8))
    assert not takes(torch.zeros(1, 8, 1, 8), k)  # heads not a multiple
    bf16 = torch.zeros(1, 9, 1, 8, dtype=torch.bfloat16)
    assert not takes(bf16, k.to(torch.bfloat16))  # bf16 products are slower than SDPA


@pytest.mark.model
def test_the_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``src/leyline/evals/bench_decode_attention.py`` smoke run, in-model A/B included (no timing
    asserted)."""
    from leyline.evals.bench_decode_attention import main

    out = benchmark_lines(main, capsys)
    assert len([line for line in out if line.startswith(("float32", "bfloat16"))]) == 2
    arms = [line.split()[0] for line in out if " ms " in line and "ratio" in line]
    assert arms == ["splice_logits", "delete_logits", "decode_step"] * 2  # one set per dtype


def test_long_decode_steps_and_splices_through_the_path_match_a_plain_forward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``MIN_KEYS`` cached tokens a decode step and a splice's last token run
    ``single_query_attention`` inside the model (the kernel where it loads, else the matrix
    products); their logits equal transformers' own forward (eager attention, no cache) of
    the same tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import leyline.engine.attention as attention
    from leyline.engine.cpu.switches import OVERRIDES
    from leyline.engine.engine import Engine
    from leyline.engine.models import LoadedModel
    from leyline.engine.session import SessionCache
    from leyline.protocol.algebra import Edit
    from leyline.protocol.directives import Mode

    config = LlamaConfig(
        vocab_size=256, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=4096,
        initializer_range=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    eager = copy.deepcopy(config)  # the models must not share one config object
    eager._attn_implementation = "eager"
    reference = LlamaForCausalLM(eager).eval()
    reference.load_state_dict(model.state_dict())
    engine = Engine(LoadedModel(model, None, "tiny-llama-4k", "random", random_weights=True))
    n = MIN_KEYS + 40
    tokens = torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(1)).tolist()

    def plain(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return reference(input_ids=torch.tensor([ids])).logits[0, -1].float()

    calls: list[int] = []

    def counted(*args: object) -> torch.Tensor:
        calls.append(1)
        return single_query_attention(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(attention, "single_query_attention", counted)
    # the model's own dispatch: the fused loop calls the kernel directly, bitwise the same
    # (tests/engine/test_fused_forward.py)
    monkeypatch.setitem(OVERRIDES, "fused_forward", "off")
    session = SessionCache(engine)
    session.prefill(tokens)
    assert not calls  # a prefill's queries come in runs
    step = session.fork()
    step.prefill([*tokens, 7])  # one decode step over n cached keys
    torch.testing.assert_close(step.next_token_logits(), plain([*tokens, 7]), atol=2e-4, rtol=0)
    assert len(calls) == 2  # one per layer
    # A same-length replacement near the end (nothing moves; the replacement and the last
    # token run in one pass, the last token alone in its own run of queries): its logits
    # are those of a forward of the edited tokens, up to the kept tokens' stale context.
    edit = Edit(n - 4, n - 2, (9, 10), Mode.amortize)
    session.apply_edits([edit], want_logits=True)
    assert len(calls) == 4
    new = [*tokens[: n - 4], 9, 10, *tokens[-2:]]
    torch.testing.assert_close(session.next_token_logits(), plain(new), atol=2e-4, rtol=0)
