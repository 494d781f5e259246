"""A converted model copy in the user cache dir, written atomically and checked before use.

Layout: ``<cache>/models/<key>/`` holds the HF files plus ``leyline-complete.json``, the
integrity marker, written last. A copy is built in a sibling temp dir and renamed into
place, so a crash mid-conversion leaves no half copy at ``<key>``. A copy that was damaged
afterwards (truncated, overwritten, marker missing) fails :func:`verify_copy` and is rebuilt,
never loaded.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

MARKER = "leyline-complete.json"
MARKER_FORMAT = 1
_SAMPLES = 16
_CHUNK = 1 << 16


def cache_root() -> Path:
    """``$LEYLINE_CACHE_DIR``, else ``$XDG_CACHE_HOME/leyline``, else ``~/.cache/leyline``."""
    explicit = os.environ.get("LEYLINE_CACHE_DIR")
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "leyline"


def _sampled_digest(path: Path, size: int) -> str:
    """blake2b of the size and _SAMPLES chunks spread over the file, first and last included."""
    h = hashlib.blake2b(str(size).encode(), digest_size=16)
    offsets = {0, max(0, size - _CHUNK)}
    offsets.update(i * max(1, size // _SAMPLES) for i in range(_SAMPLES))
    with path.open("rb") as f:
        for off in sorted(o for o in offsets if o < max(size, 1)):
            f.seek(off)
            h.update(f.read(_CHUNK))
    return h.hexdigest()


def _full_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _describe(directory: Path) -> dict[str, dict[str, object]]:
    files: dict[str, dict[str, object]] = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file() and p.name != MARKER):
        size = path.stat().st_size
        files[path.relative_to(directory).as_posix()] = {
            "size": size,
            "sampled": _sampled_digest(path, size),
            "sha256": _full_digest(path),
        }
    return files


def verify_copy(directory: Path, source: dict[str, object], *, full: bool = False) -> bool:
    """True when ``directory`` holds a complete copy made from ``source``, unchanged since.
    The default check is cheap (sizes plus a digest of sampled chunks, well under a second
    for the 517 MB SmolLM2 copy); ``full=True`` hashes every byte."""
    try:
        marker = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("format") != MARKER_FORMAT or marker.get("source") != source:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or not files:
        return False
    for rel, meta in files.items():
        path = directory / rel
        try:
            size = path.stat().st_size
        except OSError:
            return False
        if size != meta.get("size") or _sampled_digest(path, size) != meta.get("sampled"):
            return False
        if full and _full_digest(path) != meta.get("sha256"):
            return False
    return True


def ensure_copy(
    directory: Path,
    source: dict[str, object],
    build: Callable[[Path], object],
) -> Path:
    """Return ``directory`` holding a verified copy, building it with ``build(tmpdir)`` if needed.

    ``source`` identifies what the copy was made from (file, size, mtime, converter
    version); a copy made from something else is rebuilt.
    """
    if verify_copy(directory, source):
        return directory
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        build(tmp)
        marker = {"format": MARKER_FORMAT, "source": source, "files": _describe(tmp)}
        (tmp / MARKER).write_text(json.dumps(marker, indent=1, sort_keys=True))
        if directory.exists():  # damaged or stale: never loaded, replaced
            shutil.rmtree(directory)
        try:
            os.replace(tmp, directory)
        except OSError:
            # Another process won the race; use its copy if it is sound.
            if not verify_copy(directory, source):
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return directory
