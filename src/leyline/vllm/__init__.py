"""The vLLM backend (issue 47; docs/vllm-design.md): Leyline directives executed through
vLLM's own extension points (a KV connector, endpoint and general plugins).

The backend and the endpoint plugin (``backend``, ``endpoint``, ``plugin``) send orders
to the KV connector, built on:

* ``connector``: ``LeylineConnector`` (vLLM's ``KVConnectorBase_V1``), delegating to
  ``scheduler_side`` (pins, loads planned, purges, answers) and ``worker_side`` (rows
  gathered, keys rotated, scattered before the forward); ``link`` is the order format.

* ``holds`` (engine core) and ``skills`` (API server): COMPOSE's skills, vLLM's prefill of
  each held out of eviction by a reference in the ``BlockPool`` while registered.
* ``sources``: where vLLM cached a (salt, tokens) sequence (its block ids), and the purge.
* ``kv_layout``: rows of the attention backend's per-layer KV tensor, learned from the
  backend's own cache write; keys moved with their rope band rotated.
* ``rope_source``: the rope band vLLM rotated its keys with, read from its rotary modules
  (default, llama3, YaRN, DeepSeek-YaRN; any other is ``unsupported_rope``).

Only the modules that need vLLM import it: ``import leyline.vllm`` never does.
"""
