"""Build the CPU kernels' C sources (``csrc/``) once per machine and load them with ctypes.

The one place that compiles: the system C compiler (``$CC``, ``cc``, ``gcc`` or ``clang``)
builds each kernel into ``$LEYLINE_CACHE_DIR/kernels`` (default ``~/.cache/leyline/kernels``),
keyed by a hash of its sources, flags and compiler; OpenMP builds share torch's thread pool
(``libgomp``), a compiler without OpenMP gives a one-thread build. ``python -m
leyline.engine.cpu.build`` builds every kernel ahead of time.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import torch

from leyline.engine.cpu import switches

K = TypeVar("K")
CSRC = Path(__file__).with_name("csrc")
"""The kernels' C sources."""
_INCLUDE = re.compile(r'^#include "([^"]+)"', re.MULTILINE)


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


AMX_FLAGS = ("-mamx-tile", "-mamx-bf16")
"""The compiler flags for bf16 products on the CPU's tile unit (AMX)."""


def amx_flags(flags: list[str]) -> list[str]:
    """:data:`AMX_FLAGS` where a kernel built with ``flags`` may use the tile unit: an
    AVX-512 build, a CPU with AMX-BF16 and a compiler that takes the flags; else none."""
    if "-mavx512f" in flags and "amx_bf16" in cpu_flags() and compiler_accepts(*AMX_FLAGS):
        return list(AMX_FLAGS)
    return []


_CTYPES: dict[str, Any] = {
    "i": ctypes.c_int32,
    "q": ctypes.c_int64,
    "p": ctypes.c_void_p,
    "f": ctypes.c_float,
}


def bind(lib: ctypes.CDLL, name: str, args: str, returns: str | None = "i") -> Any:
    """``lib``'s function ``name`` typed by one letter per argument (``i`` int32, ``q``
    int64, ``p`` pointer, ``f`` float; spaces ignored) and for the result (None: void)."""
    fn = lib[name]
    fn.argtypes = [_CTYPES[c] for c in args.replace(" ", "")]
    fn.restype = None if returns is None else _CTYPES[returns]
    return fn


class Library:
    """A kernel's loaded shared library; each kernel's class types its functions in
    :meth:`setup` (with :func:`bind`)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, threaded: bool) -> None:
        self.path = path
        self.threaded = threaded
        """Built with OpenMP: calls split their work over ``torch.get_num_threads()``."""
        self.setup(lib)

    def setup(self, lib: ctypes.CDLL) -> None:
        raise NotImplementedError


def sources(name: str) -> list[Path]:
    """``csrc/<name>`` and every file it includes with quotes, in the order first met (the
    files a build reads, so all of them key its cached library)."""
    found: list[Path] = []
    todo = [CSRC / name]
    while todo:
        path = todo.pop(0)
        if path not in found:
            found.append(path)
            todo += [path.parent / inc for inc in _INCLUDE.findall(path.read_text())]
    return found


def _build(cc: str, flags: list[str], source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        built = Path(tmp) / target.name
        subprocess.run(
            [cc, *flags, str(source), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, target)  # atomic: a concurrent loader sees all of it or nothing


def _load_variant(
    name: str, source: str, flags: list[str], cc: str, version: str
) -> tuple[ctypes.CDLL, Path]:
    files = sources(source)
    texts = [f"{path.name}\0{path.read_text()}" for path in files]
    key = "\0".join([*texts, cc, version, *flags, platform.machine()])
    target = cache_dir() / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if not target.exists():
        _build(cc, flags, files[0], target)
    try:
        return ctypes.CDLL(str(target)), target
    except OSError:  # a damaged cached copy: build it again, once
        _build(cc, flags, files[0], target)
        return ctypes.CDLL(str(target)), target


def load_kernel(
    name: str,
    source: str,
    flags: Callable[[bool], list[str]],
    wrap: Callable[[ctypes.CDLL, Path, bool], K],
) -> tuple[K | None, KernelStatus]:
    """Build (or reuse) ``csrc/<source>`` as ``<name>-<hash>.so`` and load it;
    ``flags(openmp)`` gives the compiler flags and ``wrap(lib, path, threaded)`` the caller's
    typed handle. Tries an OpenMP build first, then a one-thread one."""
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


KERNELS: dict[str, LazyKernel[Any]] = {}
"""Every kernel by name, in the order their modules were imported."""
_warned = False


class LazyKernel(Generic[K]):
    """A kernel built and loaded on first use, once per process (thread-safe), unless the
    wing's switch has it off (``switches``); the module of each kernel holds one and exposes
    its ``load()`` and ``status()``. Every one made is listed in :data:`KERNELS`."""

    def __init__(
        self,
        name: str,
        flags: Callable[[bool], list[str]],
        wrap: Callable[[ctypes.CDLL, Path, bool], K],
    ) -> None:
        self.name = name
        self._args = (name, f"{name}.c", flags, wrap)
        self._lock = threading.Lock()
        self._loaded: K | None = None
        self._status: KernelStatus | None = None
        KERNELS[name] = self

    def build(self) -> KernelStatus:
        """Build and load it (whatever the switch says), once per process."""
        if self._status is None:
            with self._lock:
                if self._status is None:
                    self._loaded, self._status = load_kernel(*self._args)
        return self._status

    def load(self) -> K | None:
        """The kernel, or None if switched off or unusable (see :meth:`status`)."""
        if switches.refusal(self.name) or not self.build().available:
            _warn_off()
            return None
        return self._loaded

    def status(self) -> KernelStatus:
        """Whether :meth:`load` finds a kernel, and the library's path or the reason."""
        off = switches.refusal(self.name)
        return KernelStatus(False, off) if off else self.build()


def _warn_off() -> None:
    """One warning line per process naming every kernel that is off, and why."""
    global _warned
    if _warned:
        return
    _warned = True
    from leyline.engine import cpu

    off = [f"{name} ({state[5:]})" for name, state in cpu.status().items() if state != "on"]
    switches.log.warning("CPU kernels off, torch runs their work: %s", "; ".join(off))
