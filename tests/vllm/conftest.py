"""Tests of the vLLM backend against vLLM 0.32.0's real classes (CPU).

Run them in the backend's own environment (vLLM pins its own torch and transformers)::

    bash scripts/vllm/setup_env.sh
    .venv-vllm/bin/python -m pytest -p no:cacheprovider tests/vllm

Collected by an interpreter without vllm (the main venv), nothing here is collected.
"""

from __future__ import annotations

import importlib.util

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]

if HAS_VLLM:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    # The engine core seeds the block hasher once per process; so do the tests.
    init_none_hash(get_hash_fn_by_name("sha256"))
