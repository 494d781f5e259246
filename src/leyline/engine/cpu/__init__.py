"""The CPU-speed wing: C kernels and packed weights the engine uses where they load.

One switch turns it off (``LEYLINE_CPU_KERNELS=0``, ``switches``); :func:`status` says
which compiled kernel is on, and why any is off.
"""

from __future__ import annotations

import importlib

KERNEL_MODULES = ("attention_kernel", "rope_kernel", "linear_kernel", "layer_kernel")
"""The compiled kernels, each a module of this package with a ``csrc/<name>.c``."""


def status() -> dict[str, str]:
    """Per compiled kernel, ``on`` or ``off: <why>`` (building it on first call)."""
    from leyline.engine.cpu import kernel_build

    for name in KERNEL_MODULES:
        importlib.import_module(f"{__name__}.{name}")
    return {
        name: "on" if state.available else f"off: {state.detail}"
        for name in KERNEL_MODULES
        for state in [kernel_build.KERNELS[name].status()]
    }
