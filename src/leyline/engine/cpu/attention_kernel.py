"""One query's attention over a long KV cache on the CPU, fp32 or bf16, and runs of a few
queries (a splice's replacement), in C (``csrc/attention_kernel.c``, which says how).

A decode step, a batched decode row and a splice's last token read every cached key and
value once: this kernel streams them at memory speed where torch's CPU flash kernel does not
(bf16), with fp32 sums, grouped query heads sharing their key/value head's read.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import torch

from leyline.engine.cpu import kernel_build, run_choice
from leyline.engine.cpu.kernel_build import KernelStatus

__all__ = ["AttentionKernel", "KernelStatus", "eligible", "load", "status"]

MAX_DIM = 512
"""Widest key or value head the kernel takes (rows are widened on the stack)."""
MAX_GROUP = 16
"""Most query heads per key/value head."""
MAX_RUN_ROWS = 512
"""Most query rows (queries times query heads per key/value head) one run call takes."""
RUN_MIN_KEYS = 512
"""Fewest keys a run sees (all segments) for the engine to send it here: below about 600,
torch's flash kernel was as fast or faster (``bench_run_attention``, docs/perf.md)."""
_MIN_BYTES_PER_THREAD = 1 << 18
_MIN_RUN_WORK_PER_THREAD = 1 << 20


def eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether the kernel takes ``query [1, heads, 1, d]`` over ``key [1, kv, n, d]`` and
    ``value [1, kv, n, dv]``: CPU, all fp32 or all bf16, heads a multiple of kv heads (at
    most :data:`MAX_GROUP` per kv head), widths up to :data:`MAX_DIM`, K and V with a
    contiguous last dim."""
    return query.dim() == 4 and query.shape[2] == 1 and _takes(query, key, value, MAX_GROUP)


def run_eligible(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether :meth:`AttentionKernel.attend_runs` takes a run ``query [1, heads, m, d]``
    over ``key``/``value`` as :func:`eligible` says, with ``m`` queries times the query
    heads per kv head at most :data:`MAX_RUN_ROWS`."""
    if query.dim() != 4 or query.shape[2] < 1 or key.dim() != 4 or key.shape[1] == 0:
        return False
    rows = query.shape[2] * (query.shape[1] // key.shape[1])
    return rows <= MAX_RUN_ROWS and _takes(query, key, value, MAX_RUN_ROWS)


def _takes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, group: int) -> bool:
    return (
        query.dim() == 4
        and key.dim() == 4
        and value.dim() == 4
        and query.shape[0] == key.shape[0] == value.shape[0] == 1
        and key.shape[2] == value.shape[2] > 0
        and key.shape[1] == value.shape[1] > 0
        and query.shape[1] % key.shape[1] == 0
        and query.shape[1] // key.shape[1] <= group
        and query.shape[3] == key.shape[3]
        and 0 < key.shape[3] <= MAX_DIM
        and 0 < value.shape[3] <= MAX_DIM
        and query.dtype == key.dtype == value.dtype
        and key.dtype in (torch.float32, torch.bfloat16)
        and query.is_cpu
        and key.is_cpu
        and value.is_cpu
        and key.stride(-1) == 1
        and value.stride(-1) == 1
    )


def _check_seen(m: int, lengths: Sequence[int], seen: Sequence[Sequence[int]]) -> None:
    """``seen`` (per segment, per query) fits the segments' ``lengths``, and every query
    sees a key."""
    for n, counts in zip(lengths, seen, strict=True):
        if len(counts) != m or not all(0 <= x <= n for x in counts):
            raise ValueError(f"seen: {m} counts within the segment's {n} keys")
    if any(sum(c) == 0 for c in zip(*seen, strict=True)):
        raise ValueError("every query of a run must see at least one key")


def _geometry(t: torch.Tensor) -> tuple[object, ...]:
    return (tuple(t.shape), t.stride(), t.dtype, t.device)


class _SegmentTable:
    """The key/value segments of one call as the C functions take them, in one int64 array
    (a ctypes array per argument cost ~20 us a call, a decode step makes 30):
    lengths, key pointers, value pointers, then four strides per segment."""

    __slots__ = ("_table", "key_ptrs", "keys", "kv_heads", "lengths", "strides", "value_ptrs")

    def __init__(self, segments: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        count = len(segments)
        self.kv_heads = segments[0][0].shape[1]
        values: list[int] = [k.shape[2] for k, _ in segments]
        self.keys = sum(values)
        """Keys over all segments."""
        values += [k.data_ptr() for k, _ in segments]
        values += [v.data_ptr() for _, v in segments]
        for k, v in segments:
            values += (k.stride(1), k.stride(2), v.stride(1), v.stride(2))
        self._table = array("q", values)  # kept alive with the addresses below
        base = self._table.buffer_info()[0]
        self.lengths, self.key_ptrs = base, base + 8 * count
        self.value_ptrs, self.strides = base + 16 * count, base + 24 * count


class PreparedCall:
    """One call of the kernel, a lone query's or a run's, over the same key segments in each
    layer of a forward (an in-place edit's layers read the same positions of their own
    buffers): checked and tabled once (:meth:`AttentionKernel.prepare`), so that a call
    costs the C function and its output alone. :meth:`AttentionKernel.attend_segments` and
    :meth:`~AttentionKernel.attend_runs` are one layer's such call. Their checks and tables
    on every call were much of the Python a splice spent around its attention's calls
    (docs/perf.md)."""

    __slots__ = ("_fn", "_qshape", "_scale", "_seen", "_tables", "_threads", "bf16", "dv")

    def __init__(
        self,
        kernel: AttentionKernel,
        layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        heads: int,
        m: int,
        scale: float | None,
        seen: Sequence[Sequence[int]] | None,
    ) -> None:
        """``layers``: per layer, the segments' ``(key, value)``, already checked alike;
        ``seen``: per segment, how many of its first keys each of the ``m`` queries sees (a
        run), or None for a lone query (``m == 1``, every key)."""
        key, value = layers[0][0]
        kv_heads, d, self.dv = key.shape[1], key.shape[3], value.shape[3]
        self._tables = [_SegmentTable(segments) for segments in layers]
        self._qshape = (len(layers[0]), heads, m, d)
        self._scale = d**-0.5 if scale is None else scale
        self.bf16 = key.dtype == torch.bfloat16
        threads = torch.get_num_threads() if kernel.threaded else 1
        keys = self._tables[0].keys
        if seen is None:
            self._fn, self._seen = kernel._fn, None
            work = keys * kv_heads * (d + self.dv) * key.element_size() // _MIN_BYTES_PER_THREAD
        else:  # compute-bound where a lone query is bandwidth-bound: threads by multiply-adds
            self._fn, self._seen = kernel._runs, array("q", [x for c in seen for x in c])
            work = keys * heads * m * (d + self.dv) // _MIN_RUN_WORK_PER_THREAD
        self._threads = max(1, min(threads, work))

    def __call__(
        self, layer: int, queries: torch.Tensor, lse: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Attention at ``layer`` of ``queries``, fp32 ``[segments, heads, m, d]``
        contiguous (each segment's own), as fp32 ``[heads, m, dv]``; a lone query's call
        also writes the log-sum-exp into ``lse`` (fp32 ``[heads]``) when given."""
        if (
            tuple(queries.shape) != self._qshape
            or queries.dtype != torch.float32
            or not queries.is_contiguous()
        ):
            raise ValueError(f"queries: fp32 {list(self._qshape)} contiguous expected")
        count, heads, m, d = self._qshape
        if lse is not None and (
            self._seen is not None
            or lse.numel() != heads
            or lse.dtype != torch.float32
            or not lse.is_contiguous()
        ):
            raise ValueError(f"lse: a lone query's call writes fp32 [{heads}] contiguous")
        t = self._tables[layer]
        out = torch.empty(heads, m, self.dv, dtype=torch.float32)
        if self._seen is None:
            rc = self._fn(
                count, queries.data_ptr(), heads, t.kv_heads, t.lengths, d, self.dv,
                self._scale, t.key_ptrs, t.value_ptrs, t.strides, int(self.bf16),
                out.data_ptr(), None if lse is None else lse.data_ptr(), self._threads,
            )  # fmt: skip
        else:
            rc = self._fn(
                count, queries.data_ptr(), heads, t.kv_heads, m, t.lengths,
                self._seen.buffer_info()[0], d, self.dv, self._scale, t.key_ptrs,
                t.value_ptrs, t.strides, int(self.bf16), out.data_ptr(), self._threads,
            )  # fmt: skip
        if rc != 0:
            raise ValueError(f"attention kernel refused its arguments (rc={rc})")
        return out


class AttentionKernel(kernel_build.Library):
    """The loaded shared library."""

    def setup(self, lib: ctypes.CDLL) -> None:
        self._fn = kernel_build.bind(lib, "leyline_single_query_segments", "ipqqpqqf pppippi")
        self._runs = kernel_build.bind(lib, "leyline_query_run_segments", "ipqqqppqqf pppipi")
        self.amx = bool(lib.leyline_attention_amx_ready())
        """bf16 products run on the CPU's tile unit (built with AMX, and the OS lets this
        process use it): query runs' scores, a lone query's scores and weighted values."""
        self.runs_vectorised = bool(lib.leyline_query_runs_vectorised())
        """Query runs of widths that are multiples of 16 (up to 128) run on AVX-512 code,
        faster than torch's flash kernel on an AVX-512 CPU without AMX (docs/perf.md).
        Elsewhere (portable, AVX2 row by row) they measured slower than it, so
        :meth:`takes_run` says no."""
        self.run_choice = run_choice.RunChooser(self)
        """Where vectorised, whether the runs beat torch's flash kernel on this CPU, per
        shape (measured once: on a Xeon with AMX torch's bf16 kernel wins)."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        scale: float | None,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """``softmax(q k^T * scale) v`` over every key (no mask), ``[1, heads, 1, dv]`` in
        the query's dtype (SDPA's layout); ``scale`` defaults to ``d ** -0.5``. Raises
        ``ValueError`` for tensors :func:`eligible` refuses (``checked``: the caller has
        just asked :func:`eligible`, so it is not asked again)."""
        out, _ = self.attend_segments([(query, key, value)], scale, checked=checked)
        return out.to(query.dtype)

    def attend_segments(
        self,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        scale: float | None,
        *,
        with_lse: bool = False,
        checked: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One query's attention over the union of several key segments, each ``(query,
        key, value)`` with its own query (e.g. rotated for that segment), in one call:
        fp32 ``[1, heads, 1, dv]`` and, ``with_lse``, the log-sum-exp ``[1, heads, 1]``.
        Every segment must be :func:`eligible` (``checked``: the caller has just asked, so
        it is not asked again), all with the same heads, widths and dtype."""
        first_q, first_k, first_v = segments[0]
        heads, d = first_q.shape[1], first_q.shape[3]
        kv_heads, dv, dtype = first_k.shape[1], first_v.shape[3], first_k.dtype
        for q, k, v in segments:
            if not (checked or eligible(q, k, v)) or (
                q.shape[1], k.shape[1], v.shape[3], k.dtype
            ) != (
                heads, kv_heads, dv, dtype
            ):  # fmt: skip
                raise ValueError("tensors not eligible for the attention kernel")
        qs = torch.stack([q.reshape(heads, 1, d) for q, _, _ in segments]).to(torch.float32)
        call = PreparedCall(self, [[(k, v) for _, k, v in segments]], heads, 1, scale, None)
        lse = torch.empty(heads, dtype=torch.float32) if with_lse else None
        out = call(0, qs, lse).reshape(1, heads, 1, dv)
        return out, None if lse is None else lse.reshape(1, heads, 1)

    def takes_run(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        keys: int | None = None,
        parts: int = 1,
    ) -> bool:
        """Whether a run of queries is worth sending here rather than to torch's flash
        kernel: :func:`run_eligible`, on the vectorised path, at least two queries, and
        measured faster than torch's for this shape and number of keys on this CPU
        (``run_choice``); ``keys``: all the run sees over its ``parts`` segments (default:
        ``key``'s, one segment)."""
        d, dv = query.shape[-1], value.shape[-1]
        return (
            self.runs_vectorised
            and query.dim() == 4
            and query.shape[2] >= 2
            and d % 16 == 0
            and dv % 16 == 0
            and d <= 128
            and dv <= 128
            and run_eligible(query, key, value)
            and self.run_choice.kernel_wins_over(
                query, key, value, key.shape[2] if keys is None else keys, parts
            )
        )

    def attend_runs(
        self,
        segments: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor, Sequence[int]]],
        scale: float | None,
        *,
        checked: bool = False,
    ) -> torch.Tensor:
        """A run of ``m`` queries over several key segments, each ``(query [1, heads, m, d],
        key, value, seen)`` with its own query and ``seen[j]``, how many of the segment's
        first keys query ``j`` sees (0 to its length): per query, the softmax over the union
        of what it sees, in one call; fp32 ``[1, heads, m, dv]``. A causal run of queries at
        the last ``m`` positions of a cache of ``n`` sees ``n - m + 1 + j``. Every segment
        must be :func:`run_eligible` (``checked``: the caller has just asked, through
        :meth:`takes_run`), all alike, and every query must see a key."""
        first_q, first_k, first_v, _ = segments[0]
        heads, m = first_q.shape[1], first_q.shape[2]
        kv_heads, dv, dtype = first_k.shape[1], first_v.shape[3], first_k.dtype
        for q, k, v, _ in segments:
            if not (checked or run_eligible(q, k, v)) or (
                q.shape[1:3],
                k.shape[1],
                v.shape[3],
                k.dtype,
            ) != ((heads, m), kv_heads, dv, dtype):
                raise ValueError("tensors not eligible for the attention kernel")
        _check_seen(m, [seg[1].shape[2] for seg in segments], [seg[3] for seg in segments])
        qs = torch.stack([q[0] for q, _, _, _ in segments]).to(torch.float32).contiguous()
        layer = [(k, v) for _, k, v, _ in segments]
        call = PreparedCall(self, [layer], heads, m, scale, [seg[3] for seg in segments])
        return call(0, qs).unsqueeze(0)

    def prepare(
        self,
        layers: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]],
        heads: int,
        m: int,
        scale: float | None,
        seen: Sequence[Sequence[int]] | None = None,
    ) -> PreparedCall:
        """The call at every layer ``i`` of :meth:`attend_segments` (``seen`` None, one
        query) or :meth:`attend_runs` (``m`` queries, ``seen`` per segment) over the
        segments ``layers[i]``, each ``(key, value)``: layer 0's are checked as those
        methods check them, every other layer's must lie alike (the same shapes, strides
        and dtype). Raises ``ValueError`` otherwise."""
        first = layers[0]
        key = first[0][0]
        query = torch.empty(1, heads, m, key.shape[3], dtype=key.dtype)
        ok = eligible if seen is None else run_eligible
        dv = first[0][1].shape[3]
        for k, v in first:
            if not ok(query, k, v) or (k.shape[1], v.shape[3], k.dtype) != (
                key.shape[1],
                dv,
                key.dtype,
            ):
                raise ValueError("tensors not eligible for the attention kernel")
        if seen is not None:
            _check_seen(m, [k.shape[2] for k, _ in first], seen)
        shape = [_geometry(t) for segment in first for t in segment]
        if any([_geometry(t) for segment in other for t in segment] != shape for other in layers):
            raise ValueError("every layer's segments must lie as the first layer's do")
        return PreparedCall(self, layers, heads, m, scale, seen)


def _flags(openmp: bool) -> list[str]:
    # 512-bit vectors and contracted multiply-adds: faster than 256-bit (docs/perf.md)
    # (nothing in this kernel promises bitwise equality with an eager path).
    flags = [*kernel_build.base_flags(openmp), "-ffp-contract=fast"]
    if "-mavx512f" in flags:
        flags.append("-mprefer-vector-width=512")
    return flags + kernel_build.amx_flags(flags)  # query runs' bf16 scores on the tile unit


_kernel = kernel_build.LazyKernel("attention_kernel", _flags, AttentionKernel)
load = _kernel.load
"""The kernel, compiled and loaded on first use (once per process); None if unusable."""
status = _kernel.status
"""Whether :func:`load` finds a kernel, and the library's path or the reason."""
