"""What the tests of the engine's compiled CPU kernels share: the oneDNN skip, the exact
product a linear layer is measured against, the portable build of the attention kernel,
and the smoke run of a kernel's benchmark."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from leyline.engine.cpu import attention_kernel, kernel_build
from leyline.engine.cpu.attention_kernel import AttentionKernel

needs_onednn = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN"
)


def exact_linear(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    """``linear`` applied to ``x`` in fp64."""
    b = None if linear.bias is None else linear.bias.double()
    return F.linear(x.double(), linear.weight.double(), b)


def portable_attention_kernel() -> AttentionKernel:
    """The attention kernel's source built without the x86 vector flags: the portable C path
    that CPUs without AVX2 + FMA (and widths off the 8-lane paths) run. Skips the test where
    it does not build."""

    def flags(openmp: bool) -> list[str]:
        vector = ("-mavx", "-mfma", "-mprefer-vector-width")
        return [f for f in attention_kernel._flags(openmp) if not f.startswith(vector)]

    loaded, status = kernel_build.load_kernel(
        "attention_kernel_portable", "attention_kernel.c", flags, AttentionKernel
    )
    if loaded is None:
        pytest.skip(f"portable build unavailable: {status.detail}")
    return loaded


def benchmark_lines(
    main: Callable[[list[str]], int], capsys: pytest.CaptureFixture[str]
) -> list[str]:
    """What a kernel benchmark's ``main`` prints on its quick grid in fp32 and bf16, with a
    400-token in-model A/B of one run (a smoke run: no timing is asserted); it must exit 0."""
    argv = ["--quick", "--dtypes", "float32", "bfloat16", "--in-model", "400", "--model-runs", "1"]
    assert main(argv) == 0
    return capsys.readouterr().out.splitlines()
