"""Test-only SGLang plugin for the live CPU server (``make sglang-live-check``).

Never installed: ``leyline_live_shims-0.0.0.dist-info`` beside this file registers it in the
``sglang.srt.plugins`` group, and only the live server's PYTHONPATH holds this folder. SGLang
calls :func:`register` in every process, the scheduler included. Two things:

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
from typing import Any

FLAG_ENV = "LEYLINE_LIVE_ROTATION_OFF_FLAG"
SHARED_SPLICE_ENV = "LEYLINE_LIVE_SHARED_SPLICE_FLAG"


def _route_torch_native_to_mla() -> None:
    from sglang.srt.models.deepseek_common.attention_backend_handler import (
        AttentionBackendRegistry,
        _dispatch_mla_subtype,
    )

    AttentionBackendRegistry.register("torch_native", _dispatch_mla_subtype)


def _install_rotation_switch(flag: str) -> None:
    # The plugin's one rotation point (every KV row copy goes through it). If it is renamed
    # this raises at server start, and the negative-control test then fails loudly.
    from leyline.sglang import kv_rows

    rotated = kv_rows._rotated_rows

    def maybe_rotated(rows: Any, delta: int, band: Any, offset: int) -> Any:
        return rows if os.path.exists(flag) else rotated(rows, delta, band, offset)

    kv_rows._rotated_rows = maybe_rotated


def _install_shared_splice_switch(flag: str) -> None:
    # The backend's one choice of where approximate KV is built (API server process). If it
    # is renamed this raises at server start, and the mutant test then fails loudly.
    from leyline.sglang import backend

    private = backend.private_namespace

    def maybe_shared(handle: Any) -> Any:
        return handle.salt if os.path.exists(flag) else private(handle)

    backend.private_namespace = maybe_shared


def register() -> None:
    _route_torch_native_to_mla()
    flag = os.environ.get(FLAG_ENV)
    if flag:
        _install_rotation_switch(flag)
    shared = os.environ.get(SHARED_SPLICE_ENV)
    if shared:
        _install_shared_splice_switch(shared)
