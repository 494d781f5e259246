"""Test-only plugin for the live servers (``make sglang-live-check``, ``make vllm-live-check``).

Never installed: ``leyline_live_shims-0.0.0.dist-info`` beside this file registers it in
SGLang's ``sglang.srt.plugins`` group (:func:`register`) and vLLM's ``vllm.general_plugins``
(:func:`register_vllm`, loaded when ``VLLM_PLUGINS`` names ``leyline_live_shims``), and only
the live server's PYTHONPATH holds this folder. Both hosts call it in every process (SGLang's
scheduler; vLLM's API server, engine core and worker). On SGLang, three things (on vLLM the
two switches):

1. **MLA on torch_native.** SGLang's DeepSeek attention dispatch has no handler for
   ``torch_native`` and falls back to triton's, which picks the MHA prefill path on an extend
   without prefix; torch_native then reads K/V from the pool (the MLA latent) and fails with a
   shape error. Routing torch_native to the absorbed MLA path makes prefill work on CPU.
2. **A rotation-off switch** for the negative control: while the file named by
   ``LEYLINE_LIVE_ROTATION_OFF_FLAG`` exists, the plugin copies downstream KV rows without
   rotating their rope band. The live test creates the file, checks that a splice then no
   longer matches the reference engine, and removes it.
3. **A shared-splice switch**, the mutant of issue 45: while the file named by
   ``LEYLINE_LIVE_SHARED_SPLICE_FLAG`` exists, splices are built in the session's shared
   namespace (as before the fix), so strangers are served spliced KV; the isolation test
   checks that its comparison then fails.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

FLAG_ENV = "LEYLINE_LIVE_ROTATION_OFF_FLAG"
SHARED_SPLICE_ENV = "LEYLINE_LIVE_SHARED_SPLICE_FLAG"


def _route_torch_native_to_mla() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def _switch(module: Any, name: str, flag: str, off: Callable[..., Any]) -> None:
    """``module.name`` answers as ``off`` while the file ``flag`` exists. The attribute is
    the host's one point for that behaviour; if it is renamed this raises at server start,
    and the negative-control test that needs it then fails loudly."""
    on = getattr(module, name)

    def switched(*args: Any) -> Any:
        return off(*args) if os.path.exists(flag) else on(*args)

    setattr(module, name, switched)


def _unrotated(rows: Any, *_: Any) -> Any:
    return rows  # every row copied with its key as cached: no rotation


def _shared(handle: Any) -> Any:
    return handle.salt  # approximate KV built where the session's exact KV is


def _install(kv_rows: tuple[Any, str], backend: Any) -> None:
    """The two negative controls' switches: the rotation point ``kv_rows`` (a module and
    the name of its row-rotating function) and the backend's choice of namespace."""
    rotation_off, shared_splice = os.environ.get(FLAG_ENV), os.environ.get(SHARED_SPLICE_ENV)
    if rotation_off:
        _switch(*kv_rows, rotation_off, _unrotated)
    if shared_splice:
        _switch(backend, "private_namespace", shared_splice, _shared)


def register_vllm() -> None:
    from leyline.vllm import backend, worker_side

    _install((worker_side, "shift_keys"), backend)  # the worker's one rotation point


def register() -> None:
    from leyline.sglang import backend, kv_rows

    _route_torch_native_to_mla()
    _install((kv_rows, "_rotated_rows"), backend)  # every KV row copy goes through it
