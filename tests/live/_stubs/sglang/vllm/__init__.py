"""Test-only stand-in for vllm (never installed; the live server's PYTHONPATH only).

SGLang's ``RotaryEmbedding.__init__`` imports ``vllm._custom_ops.rotary_embedding`` on a
device that is neither CUDA nor SGLang's sgl_kernel CPU engine. On such a device the forward
dispatches to ``forward_native`` and never calls it, so an import that succeeds is enough.
"""
