"""Each backend's own routes for plain requests: what a client without Leyline sends, and
what it reads back (the next-token logprobs, the prompt tokens found cached, the cache's
page). The live suite is one suite; this is where the backends differ.

* ``sglang``: SGLang's ``/generate`` (token ids in, ``meta_info`` out) and ``/server_info``.
* ``vllm``: vLLM's own ``/v1/completions`` with the prompt's ids, logprobs keyed by token id
  (``return_tokens_as_token_ids``), cached tokens from ``usage.prompt_tokens_details``
  (``--enable-prompt-tokens-details``), and the block size from ``/metrics``
  (``vllm:cache_config_info``).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx

BACKENDS = ("sglang", "vllm")
BACKEND = os.environ.get("LEYLINE_LIVE_BACKEND", "sglang")
TOP = 20


@dataclass(frozen=True, slots=True)
class Generated:
    top: dict[int, float]
    """The server's top-20 next-token logprobs, token id -> logprob."""
    cached_tokens: int
    prompt_tokens: int
    report: dict[str, Any] | None = None
    """The turn's ``leyline`` report (``session_generate`` only)."""


def generate(server: httpx.Client, tokens: Sequence[int], salt: str | None = None) -> Generated:
    """One greedy token of ``tokens`` on the backend's own route (no ``leyline`` object),
    with its top-20 logprobs (log_softmax of the logits) and ``cache_salt`` if given."""
    if BACKEND == "vllm":
        out = _completion(server, tokens, 1, salt, logprobs=TOP, return_tokens_as_token_ids=True)
        top = {
            int(key.removeprefix("token_id:")): float(logprob)
            for key, logprob in out["choices"][0]["logprobs"]["top_logprobs"][0].items()
        }
        return Generated(top, _vllm_cached(out), int(out["usage"]["prompt_tokens"]))
    body = {"return_logprob": True, "top_logprobs_num": TOP}
    meta = _sglang_generate(server, tokens, 1, salt, body)["meta_info"]
    top = {int(tok): float(lp) for lp, tok, _text in meta["output_top_logprobs"][0]}
    return Generated(top, int(meta["cached_tokens"]), int(meta["prompt_tokens"]))


def generate_ids(
    server: httpx.Client, tokens: Sequence[int], max_new_tokens: int, salt: str | None = None
) -> tuple[list[int], int]:
    """``max_new_tokens`` greedy tokens of ``tokens`` on the backend's own route: their ids,
    and how many prompt tokens it found cached. Both backends then cache the prompt and all
    but the last output token (whose KV was never computed): SGLang every token, vLLM the
    full blocks among them."""
    if BACKEND == "vllm":
        out = _completion(server, tokens, max_new_tokens, salt, return_token_ids=True)
        return [int(t) for t in out["choices"][0]["token_ids"]], _vllm_cached(out)
    body = _sglang_generate(server, tokens, max_new_tokens, salt, {})
    return [int(t) for t in body["output_ids"]], int(body["meta_info"]["cached_tokens"])


def page_size(server: httpx.Client) -> int:
    """The granularity of the server's prefix cache: SGLang's ``--page-size``, vLLM's block."""
    if BACKEND == "vllm":
        reply = server.get("/metrics")
        assert reply.status_code == 200, reply.text
        found = re.search(r'vllm:cache_config_info\{[^}]*block_size="(\d+)"', reply.text)
        assert found, "no vllm:cache_config_info with a block_size in /metrics"
        return int(found.group(1))
    reply = server.get("/server_info")
    assert reply.status_code == 200, reply.text
    return int(reply.json()["page_size"])


def idle_used_cache(server: httpx.Client, timeout: float = 60.0) -> int:
    """What the server's KV cache holds at idle that nothing can evict, once no request
    runs or waits: SGLang's ``num_used_tokens`` (tokens), vLLM's ``kv_cache_usage_perc``
    times its blocks (blocks: vLLM counts cached blocks nobody references as free)."""
    if BACKEND != "vllm":
        from .test_load import _idle_used_tokens

        return _idle_used_tokens(server, timeout)
    deadline = time.monotonic() + timeout
    while True:
        metrics = _vllm_metrics(server)
        if metrics["vllm:num_requests_running"] == 0 and metrics["vllm:num_requests_waiting"] == 0:
            time.sleep(0.5)  # the gauges are the last step's: that step has ended
            metrics = _vllm_metrics(server)
            blocks = int(metrics["num_gpu_blocks"]) - 1  # vLLM's usage leaves out the null block
            return round(metrics["vllm:kv_cache_usage_perc"] * blocks)
        assert time.monotonic() < deadline, f"the server did not go idle: {metrics}"
        time.sleep(0.5)


def _vllm_metrics(server: httpx.Client) -> dict[str, float]:
    reply = server.get("/metrics")
    assert reply.status_code == 200, reply.text
    out: dict[str, float] = {}
    for name in ("vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_requests_waiting"):  # fmt: skip
        found = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", reply.text, re.M)
        assert found, f"no {name} in /metrics"
        out[name] = float(found.group(1))
    blocks = re.search(r'vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', reply.text)
    assert blocks, "no vllm:cache_config_info with num_gpu_blocks in /metrics"
    out["num_gpu_blocks"] = float(blocks.group(1))
    return out


def floor_page(n: int, page: int) -> int:
    return n - n % page


def plain_hit(n: int, page: int) -> int:
    """Prompt tokens a plain request of ``n`` tokens finds cached when all of them are: every
    one but the last (its logits are needed), rounded down to a page."""
    return floor_page(n - 1, page)


def _completion(
    server: httpx.Client, tokens: Sequence[int], n: int, salt: str | None, **extra: Any
) -> dict[str, Any]:
    body = {"prompt": list(tokens), "max_tokens": n, "temperature": 0, **extra}
    reply = server.post("/v1/completions", json=body | ({"cache_salt": salt} if salt else {}))
    assert reply.status_code == 200, reply.text
    return dict(reply.json())


def _vllm_cached(out: dict[str, Any]) -> int:
    return int((out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def _sglang_generate(
    server: httpx.Client, tokens: Sequence[int], n: int, salt: str | None, extra: dict[str, Any]
) -> dict[str, Any]:
    body = {
        "input_ids": list(tokens),
        "sampling_params": {"max_new_tokens": n, "temperature": 0.0},
        **extra,
    }
    reply = server.post("/generate", json=body | ({"cache_salt": salt} if salt else {}))
    assert reply.status_code == 200, reply.text
    return dict(reply.json())
