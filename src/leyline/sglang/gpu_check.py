"""Device check of the SGLang plugin's numerics, for a machine with a GPU but no SGLang.

SGLang's CUDA stack cannot be brought to the lent GPU machine (no network, 64 MiB per
call), so this runs what can be checked with torch + transformers alone:

1. ``rope``: the plugin's own row copy (``kv_rows.MlaRows``) on a buffer laid out exactly
   like SGLang's ``MLATokenToKVPool`` (``[size + page, 1, kv_lora_rank + rope_dim]``, bf16,
   rope band last, interleaved pairs, YaRN mscale baked in), fp32 math: checked against
   recomputing the keys at their new positions (fp64 angles), latent bitwise, and timed
   against a plain copy of the same rows.
2. ``engine``: the reference engine's splice vs a re-prefill of the edited tokens on a
   tiny random DeepSeek-V2 (next-token KL, top-1 agreement, wall time).

    python -m leyline.sglang.gpu_check                  # CUDA, full size
    python -m leyline.sglang.gpu_check --device cpu --small

Prints one JSON object; exits 1 if a numerical check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from leyline.engine.rope_band import RopeBand
from leyline.sglang.kv_rows import MlaRows

LORA, ROPE_DIM, MSCALE = 512, 64, 1.1386  # DeepSeek-V3's latent and rope band; YaRN-like mscale


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], object], device: torch.device, runs: int) -> float:
    fn()  # warm-up (kernel selection, caches)
    times = []
    for _ in range(runs):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rotate_at(raw: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE of ``raw [n, d]`` at absolute positions, fp64, times the mscale."""
    angles = positions.double()[:, None] * inv_freq.double()[None, :]
    cos, sin = angles.cos() * MSCALE, angles.sin() * MSCALE
    x, y = raw.double()[:, 0::2], raw.double()[:, 1::2]
    out = torch.empty_like(raw, dtype=torch.float64)
    out[:, 0::2], out[:, 1::2] = x * cos - y * sin, x * sin + y * cos
    return out


def _pair_ulp(ref: torch.Tensor) -> torch.Tensor:
    pair = (
        torch.unflatten(ref.abs(), -1, (-1, 2)).amax(-1, keepdim=True).expand(-1, -1, 2).flatten(-2)
    )
    return torch.pow(2.0, torch.floor(torch.log2(pair.clamp_min(1e-30))) - 7)


def check_rope(device: torch.device, tokens: int, layers: int, runs: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE_DIM, 2, dtype=torch.float32) / ROPE_DIM))
    band = RopeBand(inv_freq, "interleaved")
    size, delta = 2 * tokens + 64, -(tokens // 3)
    src = torch.arange(1, tokens + 1, device=device)
    dst = torch.arange(tokens + 33, 2 * tokens + 33, device=device)
    positions = torch.arange(tokens) + tokens // 3 + 17  # old positions; new = old + delta
    buffers, raws = [], []
    for _ in range(layers):
        buf = torch.zeros(size + 1, 1, LORA + ROPE_DIM, dtype=torch.bfloat16, device=device)
        raw = torch.randn(tokens, ROPE_DIM, generator=g)
        latent = torch.randn(tokens, LORA, generator=g)
        row = torch.cat([latent.double(), _rotate_at(raw, positions, inv_freq)], dim=-1)
        buf[src] = row.to(torch.bfloat16).unsqueeze(1).to(device)
        buffers.append(buf)
        raws.append(raw)
    rows = MlaRows(buffers, LORA, band)
    rows.copy(src, dst, delta)
    worst_ulps, latent_bitwise = 0.0, True
    for buf, raw in zip(buffers, raws, strict=True):
        ref = _rotate_at(raw, positions + delta, inv_freq).to(torch.bfloat16).double()
        got = buf[dst, 0, LORA:].double().cpu()
        worst_ulps = max(worst_ulps, float(((got - ref).abs() / _pair_ulp(ref)).max()))
        latent_bitwise &= bool(torch.equal(buf[dst, 0, :LORA], buf[src, 0, :LORA]))
    rotate_s = _timed(lambda: rows.copy(src, dst, delta), device, runs)

    def plain() -> None:
        for buf in buffers:
            buf[dst] = buf[src]

    copy_s = _timed(plain, device, runs)
    moved = tokens * layers * (LORA + ROPE_DIM) * 2
    return {
        "tokens": tokens,
        "layers": layers,
        "bytes_moved": moved,
        "max_error_pair_ulps": round(worst_ulps, 3),
        "within_1_ulp": worst_ulps <= 1.0,
        "latent_bitwise": latent_bitwise,
        "rotate_ms": round(rotate_s * 1e3, 3),
        "plain_copy_ms": round(copy_s * 1e3, 3),
        "rotate_vs_copy": round(rotate_s / copy_s, 2),
        "rotate_gb_per_s": round(2 * moved / rotate_s / 1e9, 1),
    }


def check_engine(device: torch.device, context: int, span: int, runs: int) -> dict[str, Any]:
    from leyline.engine.engine import Engine
    from leyline.engine.models import build_tiny_mla
    from leyline.engine.session import SessionCache
    from leyline.protocol.algebra import Edit, apply_edits
    from leyline.protocol.directives import Mode

    loaded = build_tiny_mla("v2")
    loaded.model.to(device)  # type: ignore[arg-type]  # transformers' @wraps(Module.to) stub
    engine = Engine(loaded)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, engine.vocab_size, (context,), generator=g).tolist()
    start = context // 4
    edit = Edit(start, start + span, (5, 6, 7, 8), Mode.amortize)
    new_tokens = apply_edits(tokens, [edit]).tokens
    base = SessionCache(engine)
    base.prefill(tokens)

    def splice() -> torch.Tensor:
        session = base.fork()
        session.apply_edits([edit])
        return session.next_token_logits()

    def reprefill() -> torch.Tensor:
        session = SessionCache(engine)
        session.prefill(new_tokens[:start])
        session.extend(new_tokens[start:])
        return session.next_token_logits()

    with torch.no_grad():
        p, q = splice().double(), reprefill().double()
        splice_s = _timed(splice, device, runs)
        reprefill_s = _timed(reprefill, device, runs)
    logp, logq = torch.log_softmax(q, -1), torch.log_softmax(p, -1)
    kl = float((logp.exp() * (logp - logq)).sum())
    return {
        "model": "tiny-mla-v2 (RANDOM WEIGHTS)",
        "context": context,
        "span": span,
        "next_token_kl": round(kl, 6),
        "top1_agrees": int(p.argmax()) == int(q.argmax()),
        "kl_finite": math.isfinite(kl),
        "splice_ms": round(splice_s * 1e3, 2),
        "reprefill_ms": round(reprefill_s * 1e3, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke test)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device; use --device cpu --small"}))
        return 2
    tokens, layers, context, runs = (256, 2, 96, 2) if args.small else (32768, 61, 2048, 5)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "rope": check_rope(device, tokens, layers, runs),
        "engine": check_engine(device, context, context // 8, runs),
    }
    ok = report["rope"]["within_1_ulp"] and report["rope"]["latent_bitwise"]
    ok = ok and report["engine"]["kl_finite"]
    report["ok"] = bool(ok)
    print(json.dumps(report, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
