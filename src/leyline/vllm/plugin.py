"""vLLM's entry points, both named ``leyline`` (``VLLM_PLUGINS=leyline`` allows both):

* ``vllm.general_plugins`` -> :func:`register`, run in every vLLM process: checks the
  runtime is the vLLM the connector was built against (a warning otherwise).
* ``vllm.endpoint_plugins`` -> :func:`endpoint`, in the API server: the ``/leyline/v1``
  routes and chat / completions with a ``leyline`` object (``endpoint``).

The KV connector itself is named by ``--kv-transfer-config`` (docs/vllm-design.md).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

BUILT_AGAINST = "0.32.0"


def register() -> None:
    import vllm

    version = str(getattr(vllm, "__version__", ""))
    if not version.startswith(BUILT_AGAINST):
        logger.warning(
            "leyline: built against vLLM %s, running %s: the connector's hooks may differ",
            BUILT_AGAINST,
            version,
        )


def endpoint() -> Any:
    from leyline.vllm.endpoint import LeylineEndpoint

    return LeylineEndpoint()
