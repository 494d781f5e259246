"""The one name SGLang imports from ``vllm._custom_ops`` on CPU; it must never run."""

from __future__ import annotations


def rotary_embedding(*_args: object, **_kwargs: object) -> None:
    raise RuntimeError("test stand-in for vllm._custom_ops.rotary_embedding: not for use")
