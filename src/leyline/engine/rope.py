"""RoPE algebra in one place: the model's own frequencies, and rotation of cached keys by delta.

Rotations compose, so moving a key cached at ``p`` to ``p + delta`` needs only
``R(delta·f)``; the rope type's attention scaling (e.g. YaRN's mscale, which transformers
bakes into its cos/sin tables) is already in the key and never applied again.
docs/engine.md ("RoPE") has the rules, the refusals and the kernel's rounding.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from leyline.core.errors import SpliceUnsupportedError
from leyline.engine.cpu import rope_kernel
from leyline.protocol.fallback import FallbackReason

Pairing = Literal["half", "interleaved"]
"""``"half"`` rotates dim ``i`` with ``i + d/2`` (HF ``rotate_half``); ``"interleaved"``
rotates ``2i`` with ``2i + 1`` (llama.cpp, DeepSeek-V2's complex form)."""

#: Rope types whose frequencies do not depend on the sequence length: a delta rotation of
#: a cached key is exact. "longrope" switches frequency sets past its original context, so
#: it is exact only below that length (``RopeSpec.max_exact_length``).
SHIFTABLE_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn", "proportional"})
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The frequencies a model rotated its cached keys with."""

    rope_type: str
    inv_freq: torch.Tensor
    """fp32, ``[rotary_dim // 2]``, exactly the model's buffer."""
    attention_scaling: float
    """Already inside every cached key (cos/sin were scaled); informational only."""
    max_exact_length: int | None = None
    """Sequences longer than this cannot be rotated exactly (longrope); None: no limit."""

    @property
    def rotary_dim(self) -> int:
        return 2 * int(self.inv_freq.numel())

    def check_length(self, length: int) -> None:
        """Raise ``SpliceUnsupportedError(unsupported_rope)`` past the exact range."""
        if self.max_exact_length is not None and length > self.max_exact_length:
            raise SpliceUnsupportedError(
                FallbackReason.unsupported_rope,
                f"{self.rope_type} RoPE switches frequencies past {self.max_exact_length} "
                f"tokens; a {length}-token sequence cannot be rotated exactly",
            )


def find_rotary_embedding(model: PreTrainedModel) -> nn.Module:
    """The model's rotary embedding module (one ``inv_freq`` buffer shared by all layers)."""
    found = [m for m in model.modules() if hasattr(m, "inv_freq") and hasattr(m, "rope_type")]
    if len(found) != 1 or not isinstance(getattr(found[0], "rope_type", None), str):
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope,
            f"expected one rotary embedding with a single rope type, found {len(found)} "
            "(per-layer-type RoPE is not supported)",
        )
    return found[0]


def rope_spec(model: PreTrainedModel) -> RopeSpec:
    """Read the model's RoPE through transformers' own init functions.

    Raises:
        SpliceUnsupportedError: ``unsupported_rope`` for dynamic NTK (its frequencies
            change with the sequence length, so cached keys cannot be shifted exactly),
            unknown rope types, or a model whose buffer disagrees with transformers' init.
    """
    module = find_rotary_embedding(model)
    # nn.Module.__getattr__ is typed Tensor | Module; find_rotary_embedding checked a str.
    rope_type: str = module.rope_type  # type: ignore[assignment]
    if rope_type not in SHIFTABLE_ROPE_TYPES and rope_type != "longrope":
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope,
            f"rope_type {rope_type!r} cannot be shifted exactly"
            + (" (dynamic NTK rescales with sequence length)" if "dynamic" in rope_type else ""),
        )
    init: Callable[..., tuple[torch.Tensor, float]] | None = ROPE_INIT_FUNCTIONS.get(rope_type)
    if init is None:
        init = getattr(type(module), "compute_default_rope_parameters", None)
    if init is None:
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope, f"no rope init function for {rope_type!r}"
        )
    inv_freq, scaling = init(model.config)
    inv_freq = inv_freq.detach().to(device="cpu", dtype=torch.float32)
    buffer = getattr(module, "original_inv_freq", module.inv_freq)
    assert isinstance(buffer, torch.Tensor)
    used = buffer.detach().float().cpu()
    if buffer.dtype != torch.float32 and used.shape == inv_freq.shape:
        # A model cast whole to a half dtype (buffers included) rotates with the rounded
        # frequencies: shifting its keys exactly means rotating with those.
        inv_freq = inv_freq.to(buffer.dtype).float()
    if used.shape != inv_freq.shape or not torch.equal(used, inv_freq):
        raise SpliceUnsupportedError(
            FallbackReason.unsupported_rope,
            "the model's rotary frequencies differ from transformers' init for its config",
        )
    max_exact = None
    if rope_type == "longrope":
        max_exact = int(model.config.rope_parameters["original_max_position_embeddings"])
    return RopeSpec(rope_type, inv_freq, float(scaling), max_exact)


def delta_cos_sin(
    inv_freq: torch.Tensor, delta: int, device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of ``delta·f`` per frequency, angles in fp64, returned in fp32.

    No attention scaling: the cached key already carries it.
    """
    angles = inv_freq.to(torch.float64) * float(delta)
    return angles.cos().float().to(device), angles.sin().float().to(device)


@functools.lru_cache(maxsize=256)
def _cos_sin_of(freq_bytes: bytes, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = torch.frombuffer(bytearray(freq_bytes), dtype=torch.float32)
    return delta_cos_sin(inv_freq, delta)


def _cached_cos_sin(inv_freq: torch.Tensor, delta: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`delta_cos_sin` on CPU, memoised by frequencies and delta: a splice rotates
    every layer by the same delta. The tensors are shared: read them, never write."""
    freq = inv_freq.detach().to(device="cpu", dtype=torch.float32).contiguous()
    return _cos_sin_of(freq.numpy().tobytes(), delta)


def _complex_ok(t: torch.Tensor) -> bool:
    """Whether pairs of ``t``'s last dim can be viewed as complex numbers in place."""
    return (
        t.dtype == torch.float32
        and t.stride(-1) == 1
        and t.storage_offset() % 2 == 0
        and all(st % 2 == 0 for st in t.stride()[:-1])
    )


def _rotate_pairs(
    dst: torch.Tensor, src: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pairing: Pairing
) -> None:
    """dst <- src rotated (fp32 bands of one shape).

    Interleaved pairs are complex numbers in place: one complex multiply, about the speed of
    a plain copy. Half-split pairs have no such view; three elementwise passes (cos over the
    whole band, then one cross term per pair member) with no temporaries run at about half
    the speed of a copy, where the textbook formula with temporaries runs at a third.
    """
    half = src.shape[-1] // 2
    if pairing == "interleaved" and _complex_ok(src) and _complex_ok(dst):
        turn = torch.complex(cos, sin)
        as_complex = torch.view_as_complex
        torch.mul(
            as_complex(torch.unflatten(src, -1, (half, 2))),
            turn,
            out=as_complex(torch.unflatten(dst, -1, (half, 2))),
        )
        return
    if pairing == "half":  # pair (i, i + d/2): view as [..., 2, d/2]
        s, d = torch.unflatten(src, -1, (2, half)), torch.unflatten(dst, -1, (2, half))
        x1, x2, y1, y2 = s[..., 0, :], s[..., 1, :], d[..., 0, :], d[..., 1, :]
        torch.mul(s, cos, out=d)
    elif pairing == "interleaved":  # pair (2i, 2i + 1): view as [..., d/2, 2]
        s, d = torch.unflatten(src, -1, (half, 2)), torch.unflatten(dst, -1, (half, 2))
        x1, x2, y1, y2 = s[..., 0], s[..., 1], d[..., 0], d[..., 1]
        torch.mul(s, cos.unsqueeze(-1), out=d)
    else:
        raise ValueError(f"unknown pairing {pairing!r}")
    y1.addcmul_(x2, sin, value=-1)  # x1·cos - x2·sin
    y2.addcmul_(x1, sin)  # x2·cos + x1·sin


def _kernel_formula(
    band_dst: torch.Tensor, band_src: torch.Tensor, pairing: Pairing
) -> Literal["addcmul", "complex"] | None:
    """Which arithmetic :func:`_rotate_pairs` would use on these bands (None: leave them to
    the eager path). Half-split: ``mul`` then ``addcmul``; interleaved: the complex
    multiply, when fp32 bands can be viewed as complex (bf16 is staged in a dense fp32
    copy, which always can)."""
    if pairing == "half":
        return "addcmul"
    if band_src.dtype == torch.bfloat16:
        return "complex"
    if _complex_ok(band_src) and _complex_ok(band_dst):
        return "complex"
    return None


@functools.cache
def _kernel_mode(formula: Literal["addcmul", "complex"], half: int) -> bool | None:
    """The kernel's ``fused`` flag that reproduces the eager ``formula`` bitwise at this
    band width, found once on a probe (the eager rounding order depends on torch's build and
    CPU: fused multiply-adds in ``addcmul`` on AVX2/NEON, none in its complex multiply). None:
    neither order matches (or no kernel), so such bands stay on the eager path."""
    kernel = rope_kernel.load()
    if kernel is None:
        return None
    pairing: Pairing = "half" if formula == "addcmul" else "interleaved"
    generator = torch.Generator().manual_seed(half)
    x = torch.randn(2, 128, 2 * half, generator=generator)
    inv_freq = (10000.0 ** (-torch.arange(half, dtype=torch.float64) / half)).float()
    cos, sin = delta_cos_sin(inv_freq, 1237)
    want = torch.empty_like(x)
    _rotate_pairs(want, x, cos, sin, pairing)
    for fused in (True, False):
        got = torch.empty_like(x)
        kernel.rotate([(got, x)], cos, sin, interleaved=pairing == "interleaved", fused=fused)
        if torch.equal(got, want):
            return fused
    return None


def _fused_plan(
    band_dst: torch.Tensor, band_src: torch.Tensor, pairing: Pairing, disjoint: bool = False
) -> tuple[rope_kernel.Band, bool] | None:
    """The kernel's description of this band and its rounding order, or None when the band
    stays on the eager path."""
    band = rope_kernel.describe(band_dst, band_src, disjoint=disjoint)
    if band is None:
        return None
    formula = _kernel_formula(band_dst, band_src, pairing)
    fused = None if formula is None else _kernel_mode(formula, band_src.shape[-1] // 2)
    return None if fused is None else (band, fused)


def _rotate_eager(
    band_dst: torch.Tensor,
    band_src: torch.Tensor,
    delta: int,
    inv_freq: torch.Tensor,
    pairing: Pairing,
) -> None:
    cos, sin = delta_cos_sin(inv_freq, delta, band_src.device)
    # Token chunks of about 1 MiB, so the later passes over a chunk hit the CPU cache
    # (one chunk when the rotation is a single complex multiply).
    single_pass = pairing == "interleaved" and _complex_ok(band_src) and _complex_ok(band_dst)
    per_token = max(1, band_src[..., :1, :].numel() * 4)
    n = band_src.shape[-2]
    step = n if single_pass else max(1, _CHUNK_BYTES // per_token)
    for a in range(0, n, step):
        chunk_src, chunk_dst = band_src[..., a : a + step, :], band_dst[..., a : a + step, :]
        if chunk_src.dtype == torch.float32:
            _rotate_pairs(chunk_dst, chunk_src, cos, sin, pairing)
        else:
            tmp = torch.empty(chunk_src.shape, dtype=torch.float32, device=band_src.device)
            _rotate_pairs(tmp, chunk_src.float(), cos, sin, pairing)
            chunk_dst.copy_(tmp)


def _rotate_many(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    delta: int,
    inv_freq: torch.Tensor,
    pairing: Pairing,
    offset: int,
    *,
    fused: bool,
    disjoint: bool = False,
) -> None:
    width = 2 * int(inv_freq.numel())
    for _, src in pairs:
        if offset < 0 or offset + width > src.shape[-1]:
            raise ValueError(
                f"rotary band [{offset}, {offset + width}) outside dim {src.shape[-1]}"
            )
    if delta == 0:
        for dst, src in pairs:
            dst.copy_(src)
        return
    if pairing not in ("half", "interleaved"):
        raise ValueError(f"unknown pairing {pairing!r}")
    stop = offset + width
    kernel = rope_kernel.load() if fused else None
    # Bands the kernel takes, grouped by (dtype, rounding order): one call per group.
    groups: dict[tuple[torch.dtype, bool], list[tuple[rope_kernel.Band, int]]] = {}
    for dst, src in pairs:
        if offset > 0:
            dst[..., :offset].copy_(src[..., :offset])
        if stop < src.shape[-1]:
            dst[..., stop:].copy_(src[..., stop:])
        whole = offset == 0 and stop == src.shape[-1]
        band_src = src if whole else src[..., offset:stop]
        band_dst = dst if whole else dst[..., offset:stop]
        plan = None if kernel is None else _fused_plan(band_dst, band_src, pairing, disjoint)
        if plan is None:
            _rotate_eager(band_dst, band_src, delta, inv_freq, pairing)
        else:
            nbytes = band_src.numel() * band_src.element_size()
            groups.setdefault((band_src.dtype, plan[1]), []).append((plan[0], nbytes))
    if not groups:
        return
    assert kernel is not None
    cos, sin = _cached_cos_sin(inv_freq, delta)
    for (dtype, order), bands in groups.items():
        for a in range(0, len(bands), rope_kernel.MAX_BANDS):
            part = bands[a : a + rope_kernel.MAX_BANDS]
            kernel.run(
                [band for band, _ in part],
                cos,
                sin,
                bf16=dtype == torch.bfloat16,
                interleaved=pairing == "interleaved",
                fused=order,
                nbytes=sum(n for _, n in part),
            )


def rotate_into(
    dst: torch.Tensor,
    src: torch.Tensor,
    delta: int,
    inv_freq: torch.Tensor,
    pairing: Pairing,
    *,
    offset: int = 0,
    eager: bool = False,
) -> torch.Tensor:
    """Write ``src`` into ``dst`` (same shape) with dims ``[offset, offset + 2·len(inv_freq))``
    rotated by ``delta``; every other dim copied bitwise. Returns ``dst``. ``offset`` places
    a partial-rotary or MLA band (``layouts`` finds it).

    The rotation runs in fp32 (angles in fp64) and is cast to ``dst.dtype``; ``delta == 0``
    is a plain copy, the identity exactly. ``src`` is never written. On CPU (fp32 or bf16
    storage) it runs as one fused pass of ``rope_kernel`` (one read and one write per key,
    about a copy's throughput) wherever that is bitwise equal to the eager ops; elsewhere,
    without the kernel, or with ``eager``, it runs the eager PyTorch ops only.
    """
    _rotate_many([(dst, src)], delta, inv_freq, pairing, offset, fused=not eager)
    return dst


rotate_into_eager = functools.partial(rotate_into, eager=True)
"""``rotate_into(..., eager=True)``: the reference the fused kernel is checked against, and
the path for other devices and dtypes."""


def rotate_many_into(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    delta: int,
    inv_freq: torch.Tensor,
    pairing: Pairing,
    *,
    offset: int = 0,
    disjoint: bool = False,
) -> None:
    """:func:`rotate_into` for every ``(dst, src)`` (e.g. one per layer), bitwise the same,
    with the fused bands rotated in one kernel call: one fork-join of the threads for a
    whole cache instead of one per layer. ``disjoint``: the caller guarantees that no
    ``dst`` shares an element with any ``src`` even where they share a storage (pieces of
    one buffer, ``in_place_edit``), so the kernel may take them."""
    _rotate_many(pairs, delta, inv_freq, pairing, offset, fused=True, disjoint=disjoint)


def move_rotated(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    delta: int,
    inv_freq: torch.Tensor,
    pairing: Pairing,
    *,
    offset: int = 0,
) -> bool:
    """Move rows inside their buffers in one kernel call: for each ``(dst, src)``, two views
    of one buffer shifted along their position dim (``dst`` may overlap ``src``), ``dst`` gets
    :func:`rotate_into`'s result for ``src``, bitwise, rows taken in the order that reads
    each before it is overwritten. Pairs must lie in distinct storages. Returns False,
    having written nothing, when the kernel cannot take every pair (no kernel, an ineligible
    view, a rounding order it cannot reproduce, ``delta == 0``): the caller moves them
    another way (pieces that do not overlap, ``in_place_edit``)."""
    kernel = rope_kernel.load()
    bands = _move_bands(pairs) if kernel is not None and delta != 0 else None
    if bands is None:
        return False
    assert kernel is not None
    width, dim = 2 * int(inv_freq.numel()), pairs[0][1].shape[-1]
    if offset < 0 or offset + width > dim:
        raise ValueError(f"rotary band [{offset}, {offset + width}) outside dim {dim}")
    probe = pairs[0][1][..., offset : offset + width]
    formula = _kernel_formula(probe, probe, pairing)
    fused = None if formula is None else _kernel_mode(formula, width // 2)
    if fused is None:
        return False
    cos, sin = _cached_cos_sin(inv_freq, delta)
    _run_move(kernel, bands, pairs, cos, sin, offset, pairing, fused)
    return True


def move_rows(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> bool:
    """:func:`move_rotated` without a rotation: every row moved bitwise (values)."""
    kernel = rope_kernel.load()
    bands = _move_bands(pairs) if kernel is not None else None
    if bands is None:
        return False
    assert kernel is not None
    _run_move(kernel, bands, pairs, None, None, 0, "half", False)
    return True


def _move_bands(
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[rope_kernel.Band] | None:
    """The kernel's descriptions of the pairs, or None unless it takes every one: one dtype
    and row width, a storage each."""
    if not pairs:
        return None
    dim, dtype = pairs[0][1].shape[-1], pairs[0][1].dtype
    if len({src.untyped_storage().data_ptr() for _, src in pairs}) != len(pairs):
        return None
    bands: list[rope_kernel.Band] = []
    for dst, src in pairs:
        band = rope_kernel.describe_move(dst, src)
        if band is None or src.shape[-1] != dim or src.dtype != dtype:
            return None
        bands.append(band)
    return bands


def _run_move(
    kernel: rope_kernel.RopeKernel,
    bands: list[rope_kernel.Band],
    pairs: Sequence[tuple[torch.Tensor, torch.Tensor]],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    offset: int,
    pairing: Pairing,
    fused: bool,
) -> None:
    src = pairs[0][1]
    nbytes = sum(s.numel() * s.element_size() for _, s in pairs)
    for a in range(0, len(bands), rope_kernel.MAX_BANDS):
        kernel.move(
            bands[a : a + rope_kernel.MAX_BANDS],
            cos,
            sin,
            dim=src.shape[-1],
            offset=offset,
            bf16=src.dtype == torch.bfloat16,
            interleaved=pairing == "interleaved",
            fused=fused,
            nbytes=nbytes,
        )


def delta_rotate(
    x: torch.Tensor, delta: int, inv_freq: torch.Tensor, pairing: Pairing, *, offset: int = 0
) -> torch.Tensor:
    """A new tensor: ``x`` with its band rotated by ``delta`` (see :func:`rotate_into`)."""
    return rotate_into(torch.empty_like(x), x, delta, inv_freq, pairing, offset=offset)
