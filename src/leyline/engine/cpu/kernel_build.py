"""Compile a C kernel once per machine and load it with ``ctypes``.

The engine's CPU kernels (``rope_kernel``: the delta rotation of cached keys;
``attention_kernel``: one query's attention over a long cache) are C sources compiled with
the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``) into
``$LEYLINE_CACHE_DIR/kernels`` (default ``~/.cache/leyline/kernels``), keyed by a hash of the
source, flags and compiler, and loaded with ``ctypes`` (which releases the GIL during a
call). OpenMP builds link ``libgomp.so.1``, which resolves to the copy torch already loaded,
so a kernel shares torch's warm thread pool; a compiler without OpenMP gives a one-thread
build. Without a compiler, on a failed build, or with the kernel's environment switch set to
``0``, :func:`load_kernel` returns None and the caller keeps its eager path; the
:class:`KernelStatus` says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import torch

K = TypeVar("K")


@dataclass(frozen=True, slots=True)
class KernelStatus:
    """Whether a compiled kernel is in use, and if not, why."""

    available: bool
    detail: str
    """The shared library's path, or the reason it is not used."""


def cache_dir() -> Path:
    """``$LEYLINE_CACHE_DIR/kernels`` (else ``$XDG_CACHE_HOME/leyline``, ``~/.cache/leyline``),
    the same root as the model copies (``models.local_copy.cache_root``)."""
    explicit = os.environ.get("LEYLINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser() / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "leyline" / "kernels"


def compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


@functools.cache
def compiler_accepts(*flags: str) -> bool:
    """Whether the C compiler builds an empty source with ``flags`` (e.g. an ISA extension
    an older compiler does not know); False without a compiler."""
    cc = compiler()
    if cc is None:
        return False
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.c"
        src.write_text("int leyline_probe(void) { return 0; }\n")
        try:
            subprocess.run(
                [cc, *flags, "-c", str(src), "-o", str(Path(tmp) / "probe.o")],
                check=True,
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.SubprocessError):
            return False
    return True


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def base_flags(openmp: bool) -> list[str]:
    """Optimised, position-independent C11 with the vector ISA torch's own kernels use here
    (AVX2 + FMA, AVX-512 where torch runs AVX-512)."""
    flags = ["-O3", "-std=c11", "-shared", "-fPIC", "-fno-strict-aliasing"]
    if openmp:
        flags.append("-fopenmp")
    capability = torch.backends.cpu.get_cpu_capability()
    if platform.machine() in ("x86_64", "AMD64") and capability in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    if platform.machine() in ("x86_64", "AMD64") and capability == "AVX512":
        flags += ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"]
    return flags


AMX_C = r"""
#ifdef __AMX_BF16__
#include <immintrin.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
/* The tile configuration ldtilecfg reads (palette 1). */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} kb_tilecfg;

/* 1 when Linux grants this process the tile state (asked per process, by any thread). */
static int kb_amx_request(void) {
    return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
}

/* The calling thread's eight tiles: rows[t] rows of 64 bytes each. */
static void kb_tiles_configure(const uint8_t rows[8]) {
    kb_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = rows[t];
    }
    /* the barrier: GCC may otherwise drop the stores into cfg, which ldtilecfg reads */
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
}

static const uint8_t kb_full_tiles[8] = {16, 16, 16, 16, 16, 16, 16, 16};
#endif
"""
"""C for kernels that use the tile unit (AMX), placed after their includes (``_GNU_SOURCE``
defined first): the tile configuration, the per-process request for the tile state and the
per-thread configuration."""
SCRATCH_C = r"""
#include <stdlib.h>
/* A thread's scratch floats, kept between calls and grown as needed: no allocation per
   call (NULL when memory runs out). */
static _Thread_local float *kb_tls;
static _Thread_local int64_t kb_tls_floats;

static float *kb_scratch(int64_t floats) {
    if (floats > kb_tls_floats) {
        free(kb_tls);
        kb_tls = malloc(sizeof(float) * (size_t)floats);
        kb_tls_floats = kb_tls ? floats : 0;
    }
    return kb_tls;
}
"""
"""C for a kernel's per-thread scratch (``kb_scratch``), placed after its includes."""
EXP_C = r"""
#include <stdint.h>
#include <string.h>
/* e^x in fp32 without a call, so that loops calling it vectorise: x = n ln2 + r (ln 2 split
   in two, so n ln2 is exact to fp32), e^r by a degree-7 polynomial in Horner form (Cephes'
   expf coefficients), 2^n built in the exponent bits; x is clamped to [-87, 88]. Within 1.02
   ulp of the exact value over that range (tests/engine/test_layer_kernel.py). */
static inline float kb_exp(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f + 12582912.0f; /* round to nearest via 1.5 * 2^23 */
    float n = t - 12582912.0f;
    float r = x - n * 0.693359375f;
    r = r - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    int32_t e = ((int32_t)n + 127) << 23;
    float s;
    memcpy(&s, &e, 4);
    return p * s;
}
"""
"""C for ``kb_exp``, the kernels' vectorisable exp (the attention's softmax, SiLU)."""
AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
"""The compiler flags for bf16 products on the CPU's tile unit (AMX)."""


def amx_flags(flags: list[str]) -> list[str]:
    """:data:`AMX_FLAGS` where a kernel built with ``flags`` may use the tile unit: an
    AVX-512 build, a CPU with AMX-BF16 and a compiler that takes the flags; else none."""
    if "-mavx512f" in flags and "amx_bf16" in cpu_flags() and compiler_accepts(*AMX_FLAGS):
        return list(AMX_FLAGS)
    return []


def _build(cc: str, flags: list[str], source: str, name: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        path = Path(tmp) / f"{name}.c"
        path.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run(
            [cc, *flags, str(path), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent loader sees all of it or nothing


def _load_variant(
    name: str, source: str, flags: list[str], cc: str, version: str
) -> tuple[ctypes.CDLL, Path]:
    key = "\0".join([source, cc, version, *flags, platform.machine()])
    target = cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        _build(cc, flags, source, name, target)
    try:
        return ctypes.CDLL(str(target)), target
    except OSError:  # a damaged cached copy: build it again, once
        _build(cc, flags, source, name, target)
        return ctypes.CDLL(str(target)), target


def load_kernel(
    name: str,
    source: str,
    flags: Callable[[bool], list[str]],
    wrap: Callable[[ctypes.CDLL, Path, bool], K],
    *,
    switch: str,
) -> tuple[K | None, KernelStatus]:
    """Build (or reuse) and load ``source``; ``flags(openmp)`` gives the compiler flags and
    ``wrap(lib, path, threaded)`` the caller's typed handle. Tries an OpenMP build first,
    then a one-thread one. ``switch``: the environment variable that turns it off."""
    if os.environ.get(switch, "1").strip().lower() in ("0", "off", "false", "no"):
        return None, KernelStatus(False, f"disabled by {switch}")
    cc = compiler()
    if cc is None:
        return None, KernelStatus(False, "no C compiler found ($CC, cc, gcc, clang)")
    try:
        version = subprocess.run(
            [cc, "--version"], check=True, capture_output=True, text=True, timeout=30
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        return None, KernelStatus(False, f"{cc} --version failed: {exc}")
    failures = []
    for openmp in (True, False):  # without OpenMP (e.g. clang lacking libomp): one thread
        try:
            lib, path = _load_variant(name, source, flags(openmp), cc, version)
            kernel = wrap(lib, path, openmp)
        except subprocess.CalledProcessError as exc:
            err = exc.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
            failures.append(f"build failed: {err[0]}")
        except (OSError, subprocess.SubprocessError, AttributeError) as exc:
            failures.append(f"build or load failed: {exc}")
        else:
            threads = "OpenMP threads" if openmp else "one thread (no OpenMP)"
            return kernel, KernelStatus(True, f"{path} ({threads})")
    return None, KernelStatus(False, "; ".join(failures))


class LazyKernel(Generic[K]):
    """A kernel built and loaded on first use, once per process (thread-safe); the module
    of each kernel holds one and exposes its ``load()`` and ``status()``."""

    def __init__(
        self,
        name: str,
        source: str,
        flags: Callable[[bool], list[str]],
        wrap: Callable[[ctypes.CDLL, Path, bool], K],
        *,
        switch: str,
    ) -> None:
        self._args = (name, source, flags, wrap)
        self._switch = switch
        self._lock = threading.Lock()
        self._loaded: K | None = None
        self._status: KernelStatus | None = None

    def load(self) -> K | None:
        """The kernel, or None if unusable (see :meth:`status`)."""
        if self._status is None:
            with self._lock:
                if self._status is None:
                    self._loaded, self._status = load_kernel(*self._args, switch=self._switch)
        return self._loaded

    def status(self) -> KernelStatus:
        """Whether :meth:`load` found a kernel, and the library's path or the reason."""
        self.load()
        assert self._status is not None
        return self._status
