"""Build every CPU kernel ahead of time: ``python -m leyline.engine.cpu.build``.

Each kernel otherwise builds at first use (``kernel_build``); this prints, per kernel, the
library built (or found in the cache) or why the build failed, and exits 1 on a failure.
"""

from __future__ import annotations

import importlib
import sys

from leyline.engine.cpu import KERNEL_MODULES, kernel_build, switches


def main() -> int:
    print(f"# cache: {kernel_build.cache_dir()}, compiler: {kernel_build.compiler()}")
    failed = 0
    for name in KERNEL_MODULES:
        importlib.import_module(f"leyline.engine.cpu.{name}")
        state = kernel_build.KERNELS[name].build()
        failed += not state.available
        print(f"{name}: {'built' if state.available else 'FAILED'}: {state.detail}")
    if switches.wing_off():
        print(f"# {switches.ENV}=0: the engine does not use them in this environment")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
